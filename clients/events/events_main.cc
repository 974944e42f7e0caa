// kvcache-events: prints a kvcached's KV events (WatchKvEvents) as JSON lines, one per
// event, on stdout; the stream's ends and reconnects go to stderr.
//
//   kvcache-events --server=127.0.0.1:50051                 # snapshot, then live events
//   kvcache-events --server=... --after=1234 --run=RUN      # resume after event 1234
//   kvcache-events --server=... --resume                    # reconnect whenever it ends
#include <cstdio>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "clients/cpp/kvcache_client.h"
#include "clients/cpp/security_flags.h"
#include "clients/events/event_watch.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvcached address (host:port or unix:/path)");
ABSL_FLAG(uint64_t, after, 0, "resume after this event id (0: start from a snapshot)");
ABSL_FLAG(std::string, run, "", "the daemon run --after belongs to (its events' daemon_run)");
ABSL_FLAG(bool, resume, false,
          "when the stream ends (error, drop, drain), reconnect after --reconnect_delay and "
          "resume from the last event received");
ABSL_FLAG(absl::Duration, reconnect_delay, absl::Seconds(1), "wait before reconnecting");
ABSL_FLAG(int64_t, max_events, 0, "exit 0 after this many events (0: never)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "prints a kvcached's KV events as JSON lines: kvcache-events --server=ADDR [--after=ID "
      "--run=RUN] [--resume]");
  absl::ParseCommandLine(argc, argv);
  kvcm::events::WatchOptions options;
  options.start.after_event_id = absl::GetFlag(FLAGS_after);
  options.start.daemon_run = absl::GetFlag(FLAGS_run);
  options.resume = absl::GetFlag(FLAGS_resume);
  options.reconnect_delay = absl::GetFlag(FLAGS_reconnect_delay);
  options.max_events = absl::GetFlag(FLAGS_max_events);
  if (options.start.after_event_id != 0 && options.start.daemon_run.empty()) {
    std::fprintf(stderr, "kvcache-events: --after needs --run (the daemon_run of that event)\n");
    return 2;
  }
  kvcm::client::ClientOptions connection;
  connection.address = absl::GetFlag(FLAGS_server);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = [&] {
    absl::Status applied = kvcm::client::ApplySecurityFlagsFromCommandLine(&connection);
    return applied.ok() ? kvcm::client::MakeChannel(connection)
                        : absl::StatusOr<std::shared_ptr<grpc::Channel>>(applied);
  }();
  if (!channel.ok()) {
    std::fprintf(stderr, "kvcache-events: %s\n", std::string(channel.status().message()).c_str());
    return 2;
  }
  auto stub = kvcache::v1::KvCache::NewStub(*channel);
  kvcm::events::WatchPosition position;
  const absl::Status status = kvcm::events::Watch(
      *stub, options,
      [](const kvcache::v1::KvEvent& event) {
        std::cout << kvcm::events::EventJson(event) << '\n' << std::flush;
        return true;
      },
      [&](const absl::Status& ended, const kvcm::events::WatchPosition& at) {
        std::fprintf(stderr, "kvcache-events: the stream ended: %s%s (after event %llu of run '%s')\n",
                     ended.ToString().c_str(), options.resume ? "; reconnecting" : "",
                     static_cast<unsigned long long>(at.after_event_id), at.daemon_run.c_str());
      },
      &position);
  return status.ok() ? 0 : 1;
}

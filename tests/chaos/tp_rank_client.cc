// chaos_tp_rank: one tensor-parallel rank of a sequence, as a process of its own, so that
// a chaos test can SIGKILL it mid-step (tests/chaos/chaos_test.cc).
//   chaos_tp_rank ADDRESS SEQUENCE RANK LAYERS SEED LAST_STEP STALL_AT
// Starts at the sequence's next step (InspectSequence), and for each step up to LAST_STEP
// sends its report (tests/chaos/chaos_client.h's scores for SEED, one head) over a step
// stream and prints "decision STEP CODE CACHE_SIZE EVICTED..." once answered. At step
// STALL_AT (0: none) it prints "stalled STEP" and waits without reporting, as a rank whose
// forward pass is still running, until it is killed (or 60 s pass: exit 3).
// Exit: 0 done, 1 usage, 2 the daemon failed a call.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "clients/cpp/kvcache_client.h"
#include "tests/chaos/chaos_client.h"

int main(int argc, char** argv) {
  using namespace kvcm;
  namespace v1 = ::kvcache::v1;
  int64_t rank = 0, layers = 0, last_step = 0, stall_at = 0;
  uint64_t seed = 0;
  if (argc != 8 || !absl::SimpleAtoi(argv[3], &rank) || !absl::SimpleAtoi(argv[4], &layers) ||
      !absl::SimpleAtoi(argv[5], &seed) || !absl::SimpleAtoi(argv[6], &last_step) ||
      !absl::SimpleAtoi(argv[7], &stall_at)) {
    std::fprintf(stderr, "usage: %s ADDRESS SEQUENCE RANK LAYERS SEED LAST_STEP STALL_AT\n",
                 argv[0]);
    return 1;
  }
  const std::string address = argv[1];
  const std::string id = argv[2];
  client::ClientOptions options;
  options.address = address;
  options.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<client::KvCacheClient>> c =
      client::KvCacheClient::Connect(options);
  if (!c.ok()) {
    std::fprintf(stderr, "chaos_tp_rank: %s\n", c.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<v1::SequenceState> state = (*c)->Inspect(id, /*include_cache=*/false);
  if (!state.ok()) {
    std::fprintf(stderr, "chaos_tp_rank: %s\n", state.status().ToString().c_str());
    return 2;
  }
  int64_t cached = state->cache_size();
  chaos::BoundedStream stream(address, absl::Now() + absl::Seconds(60));
  for (int64_t t = state->last_step() + 1; t <= last_step; ++t) {
    if (t == stall_at) {
      std::printf("stalled %lld\n", static_cast<long long>(t));
      std::fflush(stdout);
      // The stalled forward pass, until the test kills this rank: not a wait for an
      // event; the bound only lets an orphan exit should the test not get to kill it.
      absl::SleepFor(absl::Seconds(60));
      return 3;
    }
    v1::StepBatch batch;
    batch.set_rank(static_cast<int32_t>(rank));
    client::SetFloat32Scores(client::AddReport(&batch, id, t),
                             chaos::StepScores(seed, t, layers, cached + 1),
                             static_cast<int32_t>(layers), /*head_count=*/1);
    absl::StatusOr<v1::DecisionBatch> reply = stream.Step(batch);
    if (!reply.ok() || reply->decisions_size() != 1) {
      std::fprintf(stderr, "chaos_tp_rank: step %lld: %s\n", static_cast<long long>(t),
                   reply.ok() ? "no decision" : reply.status().ToString().c_str());
      return 2;
    }
    const v1::Decision& d = reply->decisions(0);
    std::printf("decision %lld %d %lld", static_cast<long long>(t), d.code(),
                static_cast<long long>(d.cache_size()));
    for (const int64_t p : d.evicted()) std::printf(" %lld", static_cast<long long>(p));
    std::printf("\n");
    std::fflush(stdout);
    if (d.code() == 0) cached = d.cache_size();
  }
  return 0;
}

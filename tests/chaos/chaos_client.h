// Shared by the chaos tests and their helper process (tp_rank_client): the deterministic
// scores of a step, what a decision says, and a step stream whose every wait ends at a
// deadline (the client library's StepStream waits as long as the daemon takes).
#ifndef KVCM_TESTS_CHAOS_CHAOS_CLIENT_H_
#define KVCM_TESTS_CHAOS_CHAOS_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/cpp/kvcache_client.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcm::chaos {

namespace v1 = ::kvcache::v1;

// Deterministic scores of step `step` of a stream seeded `seed`, for a cache of `tokens`:
// [layers, tokens] f32 in [0, 1).
inline std::vector<float> StepScores(uint64_t seed, int64_t step, int64_t layers,
                                     int64_t tokens) {
  std::vector<float> s(static_cast<size_t>(layers * tokens));
  uint64_t x = 0x9e3779b97f4a7c15ull * (static_cast<uint64_t>(step) + 1) ^ (seed << 1 | 1);
  for (float& v : s) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = static_cast<float>(x % 10000) / 10000.0f;
  }
  return s;
}

// What a decision says, to compare runs of the same steps.
struct Outcome {
  int32_t code = 0;
  int64_t cache_size = 0;
  std::vector<int64_t> evicted;
  bool operator==(const Outcome&) const = default;
};

inline Outcome OutcomeOf(const v1::Decision& d) {
  return {d.code(), d.cache_size(), {d.evicted().begin(), d.evicted().end()}};
}

// A StepStream on a channel of its own whose calls end by `deadline`: a daemon that never
// answers makes Receive fail at the deadline instead of waiting forever.
class BoundedStream {
 public:
  BoundedStream(const std::string& address, absl::Time deadline) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(64 << 20);
    channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    stub_ = v1::KvCache::NewStub(channel_);
    context_.set_deadline(absl::ToChronoTime(deadline));
    stream_ = stub_->StepStream(&context_);
  }
  ~BoundedStream() {
    context_.TryCancel();
    (void)stream_->Finish();
  }

  bool Send(const v1::StepBatch& batch) { return stream_->Write(batch); }
  absl::StatusOr<v1::DecisionBatch> Receive() {
    v1::DecisionBatch reply;
    if (!stream_->Read(&reply)) {
      return absl::UnavailableError("the step stream ended (or its deadline passed)");
    }
    return reply;
  }
  absl::StatusOr<v1::DecisionBatch> Step(const v1::StepBatch& batch) {
    if (!Send(batch)) return absl::UnavailableError("the step stream ended");
    return Receive();
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepBatch, v1::DecisionBatch>> stream_;
};

}  // namespace kvcm::chaos

#endif  // KVCM_TESTS_CHAOS_CHAOS_CLIENT_H_

// Shared by the fuzz targets: the input formats and the guards that keep the fuzzers off
// the bugs of issue 10 that are being fixed elsewhere (see docs/RELIABILITY.md).
//
// Inputs are protobuf wire format, so that seeds can be made from the golden vectors and
// libFuzzer's mutations stay close to what a client could send:
//   open_sequence_fuzzer: one kvcache.v1.OpenSequenceRequest.
//   step_batch_fuzzer:    a "step case", the wire form of
//                           message StepCase { repeated OpenSequenceRequest opens = 1;
//                                              repeated StepBatch batches = 2; }
//                         parsed by hand here (no generated code for a fuzz-only message).
#ifndef KVCM_FUZZ_FUZZ_SUPPORT_H_
#define KVCM_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/v1/kvcache.pb.h"

namespace kvcm::fuzz {

struct StepCase {
  std::vector<kvcache::v1::OpenSequenceRequest> opens;
  std::vector<kvcache::v1::StepBatch> batches;
};

// At most this many of each in a step case (the rest is ignored): the fuzzer's time goes
// to variety, not to long runs of one input.
inline constexpr int kMaxOpens = 6;
inline constexpr int kMaxBatches = 24;

// False when `data` is not a step case (an unknown field or a message that does not parse).
bool ParseStepCase(const uint8_t* data, size_t size, StepCase* out);
std::string SerializeStepCase(const StepCase& c);

// Silences protobuf's log (a proto3 string that is not UTF-8 is logged on every parse the
// fuzzer tries, which would spend its time writing to stderr). Call once, at start.
void QuietProtobufLogs();

// The longest prefill the fuzzers open.
inline constexpr int64_t kMaxFuzzTokens = int64_t{1} << 16;

// Whether `request` opens a prefill longer than `max_tokens`: a legitimate Open (up to
// --max_sequence_tokens), but one whose allocation and first step would spend the
// fuzzer's time on one input. Budgets are not capped: a sequence's memory grows with its
// cache, not with its budget. (The overflow and allocation bugs these inputs once reached
// are fixed; fuzz/regressions/ keeps the inputs that found them, replayed by fuzz.sh.)
bool TooSlowToFuzz(const kvcache::v1::OpenSequenceRequest& request,
                   int64_t max_tokens = kMaxFuzzTokens);

}  // namespace kvcm::fuzz

#endif  // KVCM_FUZZ_FUZZ_SUPPORT_H_

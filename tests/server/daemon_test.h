// DaemonTest: a gtest fixture that holds a real kvcached (DaemonProcess) and a C++ client
// of it, and the helpers the integration tests share (WaitFor: poll for what the daemon
// does after a call has returned, instead of sleeping).
#ifndef KVCM_TESTS_SERVER_DAEMON_TEST_H_
#define KVCM_TESTS_SERVER_DAEMON_TEST_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/server/daemon_process.h"
#include "tests/server/poll.h"

namespace kvcm::testing {

class DaemonTest : public ::testing::Test {
 protected:
  // Starts kvcached with `flags` (reset daemon_ first to replace a running one) and
  // connects client_ to it.
  void StartDaemon(const std::vector<std::string>& flags = {}) {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    client_ = daemon_->Connect();
    ASSERT_NE(client_, nullptr);
  }

  // The daemon's /metrics text ("" when it cannot be read, which fails the test).
  std::string Metrics() {
    absl::StatusOr<std::string> text = HttpGet(daemon_->metrics_address(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *text : "";
  }

  // Opens `request` as a sequence of `world` tensor-parallel ranks; fails the test if refused.
  void OpenTensorParallel(::kvcache::v1::OpenSequenceRequest request, int32_t world) {
    request.set_tp_world_size(world);
    const absl::StatusOr<::kvcache::v1::SequenceState> opened = client_->Open(request);
    ASSERT_TRUE(opened.ok()) << opened.status();
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::KvCacheClient> client_;
};

// PollUntil (tests/server/poll.h) as a gtest assertion: success once `done` holds; at
// `deadline`, a failure saying that `what` never happened. Use as
//   ASSERT_TRUE(WaitFor([&] { ... }, absl::Seconds(10), "the sequence was reclaimed"))
//       << what the test saw last;
// The deadline bounds a daemon that never does it; it is not a delay.
template <typename Predicate>
::testing::AssertionResult WaitFor(Predicate&& done, absl::Time deadline,
                                   absl::string_view what) {
  const absl::Time start = absl::Now();
  if (PollUntil(std::forward<Predicate>(done), deadline)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "never happened within " << absl::FormatDuration(absl::Now() - start) << ": "
         << what;
}

template <typename Predicate>
::testing::AssertionResult WaitFor(Predicate&& done, absl::Duration timeout,
                                   absl::string_view what) {
  return WaitFor(std::forward<Predicate>(done), absl::Now() + timeout, what);
}

// Scores for a cache of `tokens` (after adding the new token): [layers, tokens] f32,
// uniform in [0, 1), the same for the same seed.
inline std::vector<float> Scores(int32_t layers, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(static_cast<size_t>(layers * tokens));
  for (float& v : s) v = u(rng);
  return s;
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_SERVER_DAEMON_TEST_H_

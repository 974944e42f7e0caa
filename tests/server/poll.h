// Polling until a deadline, for the tests that watch another process: a kvcached's
// metrics, log, resident memory, sequence state or exit change after the call that caused
// the change has returned, and nothing tells the test when. A test polls for the event
// itself and never sleeps "long enough"; tests/server/daemon_test.h wraps this as WaitFor,
// a gtest assertion that names what never happened.
//
// Free of gtest, for tests/server/daemon_process.cc too. Thread-compatible: a poll calls
// its predicate on the calling thread only.
#ifndef KVCM_TESTS_SERVER_POLL_H_
#define KVCM_TESTS_SERVER_POLL_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcm::testing {

// How long a poll waits between two looks: short against the tests' deadlines (seconds),
// long enough that a poll that reads /metrics does not load the daemon it watches.
inline constexpr absl::Duration kPollInterval = absl::Milliseconds(5);

// Calls `done` until it returns true or `deadline` passes; whether it did. `done` is
// called once more after the deadline has passed, so that a machine that stalled the
// poller for the whole wait still sees an event that happened meanwhile.
template <typename Predicate>
bool PollUntil(Predicate&& done, absl::Time deadline) {
  for (;;) {
    const bool last = absl::Now() >= deadline;
    if (done()) return true;
    if (last) return false;
    absl::SleepFor(kPollInterval);
  }
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_SERVER_POLL_H_

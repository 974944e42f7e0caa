#include "cache_manager/base/clock.h"

namespace kvcm {
namespace {

class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace

const Clock* Clock::Real() {
  static const Clock* clock = new RealClock();
  return clock;
}

}  // namespace kvcm

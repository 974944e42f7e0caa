#include "kernels/stream_lanes.h"

namespace kvcm::kernels {
namespace {

thread_local int thread_lane = 0;

int Wrap(int lane) { return ((lane % kStreamLanes) + kStreamLanes) % kStreamLanes; }

}  // namespace

int ThreadStreamLane() { return thread_lane; }

void SetThreadStreamLane(int lane) { thread_lane = Wrap(lane); }

int EngineThreadStreamLane(int shard) { return 1 + Wrap(shard) % (kStreamLanes - 1); }

}  // namespace kvcm::kernels

// Stream lanes: which of a device backend's streams the calling thread enqueues on.
//
// A device has kStreamLanes streams (made on first use and kept for the program). The
// engine's threads each take a lane of their own (StepExecutor: lane 1 + shard), so a
// step never waits behind another thread's work and a launch failure is reported to the
// thread that caused it; every other thread (start-up, restore, tools) shares lane 0.
// BackendMemory::device_stream hands out the stream of the calling thread's lane.
//
// Work that must be ordered stays on one stream: a MomentumState keeps the stream it was
// made with for its whole life, and a tensor-parallel join enqueues on its sequence's
// stream (TensorParallelJoin::JoinOnDevice), whichever thread runs the step.
#ifndef KVCM_KERNELS_STREAM_LANES_H_
#define KVCM_KERNELS_STREAM_LANES_H_

namespace kvcm::kernels {

inline constexpr int kStreamLanes = 64;

// The calling thread's lane, in [0, kStreamLanes): what SetThreadStreamLane set, else 0.
int ThreadStreamLane();

// Gives the calling thread lane `lane` (taken modulo kStreamLanes; engine threads beyond
// the 63rd share lanes). Call before the thread enqueues device work.
void SetThreadStreamLane(int lane);

// The lane of engine thread `shard` (never lane 0, which the other threads share).
int EngineThreadStreamLane(int shard);

}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_STREAM_LANES_H_

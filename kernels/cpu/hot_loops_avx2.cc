// The hot loops compiled for AVX2 and F16C (x86-64 only; chosen at run time when the CPU
// has both).
// Built with -mavx2 and without FMA, so results equal the baseline's bit for bit.
#define KVCM_HOT_LOOPS_ISA avx2
#define KVCM_HOT_LOOPS_ISA_NAME "avx2"
#include "kernels/cpu/hot_loops_impl.h"

namespace kvcm::kernels::cpu {

const HotLoops& Avx2HotLoops() { return avx2::Table(); }

}  // namespace kvcm::kernels::cpu

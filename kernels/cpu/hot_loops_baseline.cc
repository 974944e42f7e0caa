// The hot loops for the build's baseline instruction set.
#define KVCM_HOT_LOOPS_ISA baseline
#define KVCM_HOT_LOOPS_ISA_NAME "baseline"
#include "kernels/cpu/hot_loops_impl.h"

namespace kvcm::kernels::cpu {

const HotLoops& BaselineHotLoops() { return baseline::Table(); }

const HotLoops& SelectedHotLoops() {
  static const HotLoops* selected = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
      return &Avx2HotLoops();
    }
#endif
    return &BaselineHotLoops();
  }();
  return *selected;
}

}  // namespace kvcm::kernels::cpu

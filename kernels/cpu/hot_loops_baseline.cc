// The hot loops for the build's baseline instruction set.
#define KVCM_HOT_LOOPS_ISA baseline
#define KVCM_HOT_LOOPS_ISA_NAME "baseline"
#include "kernels/cpu/hot_loops_impl.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace kvcm::kernels::cpu {
namespace {

#if defined(__x86_64__)
// F16C asked of cpuid: clang 14's __builtin_cpu_supports does not know "f16c".
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

}  // namespace

const HotLoops& BaselineHotLoops() { return baseline::Table(); }

const HotLoops& SelectedHotLoops() {
  static const HotLoops* selected = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && CpuHasF16c()) {
      return &Avx2HotLoops();
    }
#endif
    return &BaselineHotLoops();
  }();
  return *selected;
}

}  // namespace kvcm::kernels::cpu

// Counts the heap allocations of a test binary by replacing the global operator new and
// delete: for tests that prove a steady state allocates nothing. Include it in exactly one
// source file of a binary (it defines the replacements); read AllocationCount() before and
// after. GCC then flags every inlined delete of a new'd pointer as mismatched, hence the
// pragma.
#ifndef KVCM_TESTS_CACHE_MANAGER_COUNT_ALLOCATIONS_H_
#define KVCM_TESTS_CACHE_MANAGER_COUNT_ALLOCATIONS_H_

#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvcm::testing {
inline std::atomic<int64_t> g_allocations{0};
// Heap allocations so far (operator new calls).
inline int64_t AllocationCount() { return g_allocations.load(std::memory_order_relaxed); }
}  // namespace kvcm::testing

void* operator new(std::size_t size) {
  kvcm::testing::g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

#endif  // KVCM_TESTS_CACHE_MANAGER_COUNT_ALLOCATIONS_H_

// KVCM_CHECK: aborts on a broken programmer invariant (Abseil 2022-06 has no absl/log).
// Never for request data: that gets an absl::Status.
#ifndef KVCM_CACHE_MANAGER_BASE_CHECK_H_
#define KVCM_CACHE_MANAGER_BASE_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define KVCM_CHECK(cond)                                                            \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)

#endif  // KVCM_CACHE_MANAGER_BASE_CHECK_H_

// Early-return helpers for absl::Status (Abseil 2022-06 ships none).
#ifndef KVCM_CACHE_MANAGER_BASE_STATUS_MACROS_H_
#define KVCM_CACHE_MANAGER_BASE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVCM_STATUS_CONCAT_INNER_(a, b) a##b
#define KVCM_STATUS_CONCAT_(a, b) KVCM_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                         \
  do {                                                \
    ::absl::Status kvcm_status_ = (expr);             \
    if (!kvcm_status_.ok()) return kvcm_status_;      \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its status when not OK.
#define ASSIGN_OR_RETURN(lhs, expr) \
  KVCM_ASSIGN_OR_RETURN_IMPL_(KVCM_STATUS_CONCAT_(kvcm_statusor_, __LINE__), lhs, expr)
#define KVCM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()

#endif  // KVCM_CACHE_MANAGER_BASE_STATUS_MACROS_H_

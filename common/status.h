// Status helpers shared by every component. kvtier uses absl::Status and
// absl::StatusOr<T> everywhere; this header adds the propagation macros that
// Abseil 20220623 (Debian 12) lacks.
#ifndef KVTIER_COMMON_STATUS_H_
#define KVTIER_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVTIER_STATUS_CONCAT_INNER_(x, y) x##y
#define KVTIER_STATUS_CONCAT_(x, y) KVTIER_STATUS_CONCAT_INNER_(x, y)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define KVTIER_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status kvtier_status_ = (expr);          \
    if (!kvtier_status_.ok()) return kvtier_status_; \
  } while (0)

// KVTIER_ASSIGN_OR_RETURN(auto x, Foo()): evaluates Foo() (an absl::StatusOr),
// returns its status on error, otherwise moves the value into `lhs`.
#define KVTIER_ASSIGN_OR_RETURN(lhs, expr)                                        \
  KVTIER_ASSIGN_OR_RETURN_IMPL_(KVTIER_STATUS_CONCAT_(kvtier_statusor_, __LINE__), \
                                lhs, expr)
#define KVTIER_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#endif  // KVTIER_COMMON_STATUS_H_

// QTX_RETURN_IF_ERROR / QTX_ASSIGN_OR_RETURN: propagate absl::Status. Shared
// by the server and the client library (a private header of both: the client
// does not install it). Needs only Abseil's status headers.
// Same shape as ABSL_RETURN_IF_ERROR / ABSL_ASSIGN_OR_RETURN (Abseil 20260526),
// which our Abseil (20220623) lacks; switching later is a rename.
#ifndef QTX_COMMON_STATUS_MACROS_H_
#define QTX_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define QTX_STATUS_CONCAT_INNER_(a, b) a##b
#define QTX_STATUS_CONCAT_(a, b) QTX_STATUS_CONCAT_INNER_(a, b)

#define QTX_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status qtx_status_ = (expr);       \
    if (!qtx_status_.ok()) return qtx_status_; \
  } while (false)

#define QTX_ASSIGN_OR_RETURN(lhs, expr) \
  QTX_ASSIGN_OR_RETURN_IMPL_(QTX_STATUS_CONCAT_(qtx_statusor_, __LINE__), lhs, expr)

#define QTX_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(statusor).value()

#endif  // QTX_COMMON_STATUS_MACROS_H_

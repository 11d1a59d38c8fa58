// One error type for all of SparseX: absl::Status / absl::StatusOr, whose codes map 1:1 onto
// gRPC's. Debian's abseil (20220623) has no status macros, so these are ours.
//
//   absl::StatusOr<int> Parse(std::string_view s);
//   absl::Status Use() {
//     ASSIGN_OR_RETURN(int v, Parse("42"));
//     RETURN_IF_ERROR(Check(v));
//     return absl::OkStatus();
//   }
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define SPX_CONCAT_INNER(a, b) a##b
#define SPX_CONCAT(a, b) SPX_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status spx_status_ = (expr);           \
    if (!spx_status_.ok()) return spx_status_;     \
  } while (0)

#define SPX_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  SPX_ASSIGN_OR_RETURN_IMPL(SPX_CONCAT(spx_statusor_, __LINE__), lhs, expr)

// Test helpers for absl::Status (Abseil 20220623 has no status_matchers.h).
//   EXPECT_THAT(status_or_statusor, StatusIs(absl::StatusCode::kNotFound, HasSubstr("x")));
//   QTX_ASSERT_OK(expr);  QTX_ASSERT_OK_AND_ASSIGN(auto v, expr);
#ifndef QTX_TESTS_TESTING_STATUS_MATCHERS_H_
#define QTX_TESTS_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace qtx::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER_P2(StatusIs, code, message_matcher,
           std::string("status code ") + absl::StatusCodeToString(code)) {
  const absl::Status& s = ::qtx::testing::GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  if (s.code() != code) return false;
  return ::testing::ExplainMatchResult(message_matcher, std::string(s.message()), result_listener);
}

}  // namespace qtx::testing

#define QTX_ASSERT_OK(expr)                                          \
  do {                                                               \
    const ::absl::Status qtx_s_ = ::qtx::testing::GetStatus((expr)); \
    ASSERT_TRUE(qtx_s_.ok()) << #expr << ": " << qtx_s_.ToString();  \
  } while (false)

#define QTX_EXPECT_OK(expr)                                          \
  do {                                                               \
    const ::absl::Status qtx_s_ = ::qtx::testing::GetStatus((expr)); \
    EXPECT_TRUE(qtx_s_.ok()) << #expr << ": " << qtx_s_.ToString();  \
  } while (false)

#define QTX_TESTING_CONCAT_INNER_(a, b) a##b
#define QTX_TESTING_CONCAT_(a, b) QTX_TESTING_CONCAT_INNER_(a, b)
#define QTX_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  QTX_ASSERT_OK_AND_ASSIGN_IMPL_(QTX_TESTING_CONCAT_(qtx_so_, __LINE__), lhs, expr)
#define QTX_ASSERT_OK_AND_ASSIGN_IMPL_(so, lhs, expr)              \
  auto so = (expr);                                                \
  ASSERT_TRUE(so.ok()) << #expr << ": " << so.status().ToString(); \
  lhs = std::move(so).value()

#endif  // QTX_TESTS_TESTING_STATUS_MATCHERS_H_

#include "server/collective/kv_store.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::collective {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(KvStore, GetReturnsValuesInKeyOrder) {
  KvStore store;
  QTX_ASSERT_OK(store.Put("a", "1"));
  QTX_ASSERT_OK(store.Put("b", std::string("\0x", 2)));
  const std::string keys[] = {"b", "a"};
  QTX_ASSERT_OK_AND_ASSIGN(auto v, store.Get(keys, absl::Now() + absl::Seconds(1)));
  EXPECT_THAT(v, ElementsAre(std::string("\0x", 2), "1"));
}

TEST(KvStore, GetWaitsUntilTheLastKeyArrives) {
  KvStore store;
  QTX_ASSERT_OK(store.Put("k1", "v1"));
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> result;
  const KvStore::WaiterId id =
      store.GetAsync({"k1", "k2"}, absl::Now() + absl::Seconds(10), [&](auto r) {
        result = std::move(r);
        done.Notify();
      });
  EXPECT_NE(id, 0u);
  EXPECT_FALSE(done.HasBeenNotified());
  EXPECT_EQ(store.num_waiters(), 1u);
  std::thread setter([&] { QTX_EXPECT_OK(store.Put("k2", "v2")); });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  setter.join();
  QTX_ASSERT_OK(result);
  EXPECT_THAT(*result, ElementsAre("v1", "v2"));
  EXPECT_EQ(store.num_waiters(), 0u);
}

TEST(KvStore, DeadlineNamesTheMissingKeysAndIsOnTime) {
  KvStore store;
  QTX_ASSERT_OK(store.Put("present", "x"));
  const absl::Time start = absl::Now();
  absl::Notification done;
  absl::Status status;
  store.GetAsync({"present", "missing/1", "missing/2"}, start + absl::Milliseconds(200),
                 [&](auto r) {
                   status = r.status();
                   done.Notify();
                 });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing/1, missing/2")));
  EXPECT_THAT(std::string(status.message()), ::testing::Not(HasSubstr("present")));
  EXPECT_GE(took, absl::Milliseconds(190));
  EXPECT_LT(took, absl::Seconds(2));
}

TEST(KvStore, ShorterDeadlineArrivingLaterStillFiresFirst) {
  KvStore store;
  std::atomic<int> order{0};
  int long_pos = 0, short_pos = 0;
  absl::Notification a, b;
  store.GetAsync({"x"}, absl::Now() + absl::Seconds(2), [&](auto) {
    long_pos = ++order;
    a.Notify();
  });
  store.GetAsync({"y"}, absl::Now() + absl::Milliseconds(100), [&](auto) {
    short_pos = ++order;
    b.Notify();
  });
  ASSERT_TRUE(b.WaitForNotificationWithTimeout(absl::Seconds(1)));
  EXPECT_EQ(short_pos, 1);
  ASSERT_TRUE(a.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(long_pos, 2);
}

TEST(KvStore, CancelCompletesWithCancelled) {
  KvStore store;
  absl::Status status;
  const auto id =
      store.GetAsync({"never"}, absl::InfiniteFuture(), [&](auto r) { status = r.status(); });
  store.Cancel(id);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kCancelled, HasSubstr("cancelled")));
  store.Cancel(id);  // no-op
  EXPECT_EQ(store.num_waiters(), 0u);
}

TEST(KvStore, ErasePrefixRemovesOnlyThatGroup) {
  KvStore store;
  QTX_ASSERT_OK(store.Put("qtx/group/a/s/1", "x"));
  QTX_ASSERT_OK(store.Put("qtx/group/a/s/2", "x"));
  QTX_ASSERT_OK(store.Put("qtx/group/ab/s/1", "x"));
  EXPECT_EQ(store.ErasePrefix("qtx/group/a/"), 2u);
  EXPECT_EQ(store.num_keys(), 1u);
}

TEST(KvStore, RejectsBadKeysAndValues) {
  KvStoreLimits limits;
  limits.max_value_bytes = 4;
  limits.max_keys = 2;
  KvStore store(limits);
  EXPECT_THAT(store.Put("", "v"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(store.Put("k", "12345"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("5 bytes")));
  QTX_ASSERT_OK(store.Put("a", "1"));
  QTX_ASSERT_OK(store.Put("b", "1"));
  QTX_ASSERT_OK(store.Put("b", "2"));  // replacing is fine
  EXPECT_THAT(store.Put("c", "1"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2 keys")));
  absl::Status s;
  store.GetAsync({}, absl::InfiniteFuture(), [&](auto r) { s = r.status(); });
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no keys")));
}

TEST(KvStore, DestructorCancelsWaiters) {
  absl::Status status;
  {
    KvStore store;
    store.GetAsync({"never"}, absl::InfiniteFuture(), [&](auto r) { status = r.status(); });
  }
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kCancelled, HasSubstr("shutting down")));
}

// Issue 18 item 3: namespaces bound what a group may store, keys outside
// them are refused when required, and closing a namespace frees its memory.
TEST(KvStore, NamespacesBoundAndFreeAGroupsKeys) {
  KvStoreLimits limits;
  limits.require_namespace = true;
  limits.max_total_bytes = 1000;
  KvStore store(limits);
  EXPECT_THAT(store.Put("qtx/group/a/k", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no group is forming")));
  store.OpenNamespace("qtx/group/a/", {.max_keys = 2, .max_bytes = 100});
  QTX_ASSERT_OK(store.Put("qtx/group/a/1", "v"));
  QTX_ASSERT_OK(store.Put("qtx/group/a/1", "w"));  // replacing does not count twice
  QTX_ASSERT_OK(store.Put("qtx/group/a/2", "v"));
  EXPECT_THAT(store.Put("qtx/group/a/3", "v"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("holds 2 keys")));
  EXPECT_THAT(store.Put("qtx/group/a/2", std::string(90, 'x')),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit of 100 bytes")));
  store.OpenNamespace("qtx/group/b/", {.max_keys = 100, .max_bytes = 100000});
  EXPECT_THAT(store.Put("qtx/group/b/1", std::string(990, 'x')),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit of 1000 bytes")));
  EXPECT_EQ(store.num_bytes(), 2 * (13 + 1));
  // Closing refuses Puts at once; the keys go at erase time.
  store.CloseNamespace("qtx/group/a/", absl::Now() + absl::Hours(1));
  EXPECT_THAT(store.Put("qtx/group/a/1", "v"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("closed")));
  EXPECT_EQ(store.num_keys(), 2u);
  store.CloseNamespace("qtx/group/a/");
  store.CloseNamespace("qtx/group/b/");
  EXPECT_EQ(store.num_keys(), 0u);
  EXPECT_EQ(store.num_bytes(), 0u);
  EXPECT_EQ(store.num_namespaces(), 0u);
}

TEST(KvStore, ClosedNamespaceIsErasedByTheTimer) {
  KvStore store;
  store.OpenNamespace("qtx/group/a/", {.max_keys = 10, .max_bytes = 1000});
  QTX_ASSERT_OK(store.Put("qtx/group/a/1", "v"));
  store.CloseNamespace("qtx/group/a/", absl::Now() + absl::Milliseconds(20));
  for (int i = 0; i < 1000 && store.num_namespaces() > 0; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(store.num_namespaces(), 0u);
  EXPECT_EQ(store.num_keys(), 0u);
}

TEST(KvStore, DeadlineMessageNamesAFewKeysAndCountsTheRest) {
  KvStore store;
  std::vector<std::string> keys;
  for (int i = 0; i < 50; ++i) keys.push_back(absl::StrCat("k", i));
  absl::Status s;
  store.GetAsync(keys, absl::Now(), [&](auto r) { s = r.status(); });
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("k7 and 42 more")));
}

}  // namespace
}  // namespace qtx::server::collective

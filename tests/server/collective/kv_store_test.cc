#include "server/collective/kv_store.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

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
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               HasSubstr("missing/1, missing/2")));
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
  const auto id = store.GetAsync({"never"}, absl::InfiniteFuture(),
                                 [&](auto r) { status = r.status(); });
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
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("5 bytes")));
  QTX_ASSERT_OK(store.Put("a", "1"));
  QTX_ASSERT_OK(store.Put("b", "1"));
  QTX_ASSERT_OK(store.Put("b", "2"));  // replacing is fine
  EXPECT_THAT(store.Put("c", "1"), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2 keys")));
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

}  // namespace
}  // namespace qtx::server::collective

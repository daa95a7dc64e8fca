// server/api/executor: the worker pool (bounded FIFO queue, shutdown drains,
// stall detection) and InlineSlots.
#include "server/api/executor.h"

#include <atomic>
#include <mutex>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace qtx::server::api {
namespace {

TEST(ExecutorTest, RunsEverySubmittedTask) {
  std::atomic<int> ran{0};
  {
    Executor executor(3, 100);
    for (int i = 0; i < 50; ++i) {
      ASSERT_TRUE(executor.Submit([&ran] { ran.fetch_add(1); }));
    }
  }  // the destructor drains the queue
  EXPECT_EQ(ran.load(), 50);
}

TEST(ExecutorTest, OneWorkerRunsTasksInSubmissionOrder) {
  std::vector<int> order;
  std::mutex mu;
  Executor executor(1, 100);
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(executor.Submit([&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    }));
  }
  executor.Shutdown();
  ASSERT_EQ(order.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(order[i], i);
}

TEST(ExecutorTest, RefusesTasksBeyondTheQueueBound) {
  Executor executor(1, 2);
  absl::Notification started, release;
  ASSERT_TRUE(executor.Submit([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();  // the only worker is busy; the queue is empty
  std::atomic<int> ran{0};
  EXPECT_TRUE(executor.Submit([&ran] { ran.fetch_add(1); }));
  EXPECT_TRUE(executor.Submit([&ran] { ran.fetch_add(1); }));
  EXPECT_EQ(executor.queued(), 2u);
  EXPECT_FALSE(executor.Submit([&ran] { ran.fetch_add(100); }));  // dropped
  EXPECT_EQ(executor.queued(), 2u);
  release.Notify();
  executor.Shutdown();
  EXPECT_EQ(ran.load(), 2);
  EXPECT_EQ(executor.queued(), 0u);
}

TEST(ExecutorTest, ShutdownRunsQueuedWorkThenRefusesNewWork) {
  Executor executor(1, 10);
  absl::Notification started, release;
  std::atomic<int> ran{0};
  ASSERT_TRUE(executor.Submit([&] {
    started.Notify();
    release.WaitForNotification();
    ran.fetch_add(1);
  }));
  started.WaitForNotification();
  ASSERT_TRUE(executor.Submit([&ran] { ran.fetch_add(1); }));
  release.Notify();
  executor.Shutdown();
  EXPECT_EQ(ran.load(), 2);
  EXPECT_FALSE(executor.Submit([&ran] { ran.fetch_add(1); }));
  executor.Shutdown();  // idempotent
  EXPECT_EQ(ran.load(), 2);
}

TEST(ExecutorTest, AllWorkersBusySinceSeesAWedgedPool) {
  Executor executor(2, 10);
  const absl::Time before = absl::Now();
  absl::SleepFor(absl::Milliseconds(2));  // the tasks start strictly after `before`
  EXPECT_FALSE(executor.AllWorkersBusySince(absl::Now()));  // idle workers
  absl::Notification release;
  std::atomic<int> started{0};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(executor.Submit([&] {
      started.fetch_add(1);
      release.WaitForNotification();
    }));
  }
  while (started.load() < 2) absl::SleepFor(absl::Milliseconds(1));
  // Both workers run a task that started after `before` and at or before now.
  EXPECT_TRUE(executor.AllWorkersBusySince(absl::Now()));
  EXPECT_FALSE(executor.AllWorkersBusySince(before));
  release.Notify();
  executor.Shutdown();
  EXPECT_FALSE(executor.AllWorkersBusySince(absl::InfiniteFuture()));  // false after Shutdown
}

TEST(ExecutorTest, OneBusyWorkerOfTwoIsNotAStall) {
  Executor executor(2, 10);
  absl::Notification started, release;
  ASSERT_TRUE(executor.Submit([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();
  EXPECT_FALSE(executor.AllWorkersBusySince(absl::Now()));
  release.Notify();
}

TEST(InlineSlotsTest, BoundsConcurrentHoldersAndCountsRuns) {
  InlineSlots slots(2);
  EXPECT_EQ(slots.max_concurrent(), 2);
  EXPECT_TRUE(slots.TryAcquire());
  EXPECT_TRUE(slots.TryAcquire());
  EXPECT_FALSE(slots.TryAcquire());
  EXPECT_EQ(slots.runs(), 2u);
  slots.Release();
  EXPECT_TRUE(slots.TryAcquire());
  EXPECT_EQ(slots.runs(), 3u);
  slots.Release();
  slots.Release();
}

TEST(InlineSlotsTest, ZeroNeverRunsInline) {
  InlineSlots slots(0);
  EXPECT_FALSE(slots.TryAcquire());
  EXPECT_EQ(slots.runs(), 0u);
}

}  // namespace
}  // namespace qtx::server::api

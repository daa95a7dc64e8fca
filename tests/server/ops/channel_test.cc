#include "server/ops/channel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "server/backend/cpu_device.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
#include "tests/server/testing/op_test.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::ops {
namespace {

using ::qtx::testing::OpTest;
using tensor::DType;
using tensor::RegionSliceSpec;

// What a RecordingQueue saw; outlives the queue (which Channel::Close
// destroys).
class Record {
 public:
  // Waits up to `timeout` for at least `n` enqueued operations (a loaded
  // machine may hold the worker back for a while); the count then.
  uint64_t EnqueuedAtLeast(uint64_t n, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (enqueued() < n && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    return enqueued();
  }
  // Waits until `enqueued` has not changed for `quiet` (the worker stopped).
  uint64_t SettledEnqueued(absl::Duration quiet) {
    uint64_t last = enqueued();
    absl::Time since = absl::Now();
    while (absl::Now() - since < quiet) {
      absl::SleepFor(absl::Milliseconds(5));
      const uint64_t now = enqueued();
      if (now != last) last = now, since = absl::Now();
    }
    return last;
  }
  // Runs the completions asked for so far, as a device that finished them.
  void CompleteAll() {
    std::vector<std::pair<uint64_t, std::function<void()>>> due;
    {
      absl::MutexLock lock(&mu_);
      due.swap(pending_);
    }
    for (auto& [seq, drained] : due) {
      {
        absl::MutexLock lock(&mu_);
        completed_ = std::max(completed_, seq);
      }
      drained();
    }
  }
  uint64_t enqueued() {
    absl::MutexLock lock(&mu_);
    return enqueued_;
  }
  uint64_t max_lead() {
    absl::MutexLock lock(&mu_);
    return max_lead_;
  }
  std::vector<uint64_t> client_released() {
    absl::MutexLock lock(&mu_);
    return client_released_;
  }
  // From now on, a Release no longer drains the queue: a device that does
  // not move even after the client's waits were let through.
  void StallDevice() {
    absl::MutexLock lock(&mu_);
    stalled_ = true;
  }
  // The next `n` Releases are lost: a client stream that still runs writes
  // its own ready values over them.
  void LoseReleases(int n) {
    absl::MutexLock lock(&mu_);
    lost_releases_ = n;
  }
  int releases() {
    absl::MutexLock lock(&mu_);
    return releases_;
  }

 private:
  friend class RecordingQueue;
  absl::Mutex mu_;
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t max_lead_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  bool stalled_ ABSL_GUARDED_BY(mu_) = false;
  int lost_releases_ ABSL_GUARDED_BY(mu_) = 0;
  int releases_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> client_released_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, std::function<void()>>> pending_ ABSL_GUARDED_BY(mu_);
};

// A channel queue that only records, like a device whose stream is parked on
// a ready word that does not move: an operation counts as enqueued when its
// done write is made, and the completions the channel asks for run when the
// test says so (Record::CompleteAll), or at once after Release (the device
// then drains).
class RecordingQueue final : public backend::ChannelQueue {
 public:
  explicit RecordingQueue(Record* r) : r_(r) {}

  absl::Status WaitReady(uint64_t) override { return absl::OkStatus(); }

  absl::Status WriteDone(uint64_t value) override {
    absl::MutexLock lock(&r_->mu_);
    r_->enqueued_ = value;
    r_->max_lead_ = std::max(r_->max_lead_, value - r_->completed_);
    return absl::OkStatus();
  }

  absl::Status OnDrained(std::function<void()> drained) override {
    {
      absl::MutexLock lock(&r_->mu_);
      if (!r_->released_) {
        r_->pending_.push_back({r_->enqueued_, std::move(drained)});
        return absl::OkStatus();
      }
      r_->completed_ = r_->enqueued_;
    }
    drained();
    return absl::OkStatus();
  }

  void Release() override {
    {
      absl::MutexLock lock(&r_->mu_);
      ++r_->releases_;
      if (r_->stalled_) return;
      if (r_->lost_releases_ > 0) {
        --r_->lost_releases_;
        return;
      }
      r_->released_ = true;
    }
    r_->CompleteAll();
  }

  void ReleaseClientWaits(uint64_t value) override {
    absl::MutexLock lock(&r_->mu_);
    r_->client_released_.push_back(value);
  }

  std::string DescribeState() override {
    absl::MutexLock lock(&r_->mu_);
    return absl::StrFormat("recorded_enqueued=%d recorded_completed=%d", r_->enqueued_,
                           r_->completed_);
  }

 private:
  Record* const r_;
};

// The CPU device with a RecordingQueue for its channels (the quantizations
// themselves run on the CPU when enqueued).
class RecordingDevice final : public backend::CpuDevice {
 public:
  absl::StatusOr<std::unique_ptr<backend::ChannelQueue>> OpenChannelQueue(
      std::byte*, tensor::MemoryKind) override {
    return std::make_unique<RecordingQueue>(&record);
  }
  Record record;
};

class ChannelOpTest : public OpTest {
 protected:
  ChannelOpTest() : OpTest(1 << 16) {}
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(OpTest::SetUp());
    ctx_.device = &recording_;
    const float input[128] = {1.0f, -2.0f, 3.5f};
    std::memcpy(shm_.data() + 4096, input, sizeof(input));
  }

  // A Quantize of the [1, 128] FP32 input at offset 4096 into slices after it.
  static QuantizeRequestSpec Request() {
    QuantizeRequestSpec r;
    r.input.dtype = DType::kFloat32;
    r.input.shape = {1, 128};
    r.input.data = RegionSliceSpec{"r", 4096, 512};
    r.params.scaling = kernels::BlockScaling::kBlock1D;
    r.params.rowwise = true;
    r.params.columnwise = false;
    r.outputs.rowwise_data = RegionSliceSpec{"r", 8192, 128};
    r.outputs.rowwise_scale_inv = RegionSliceSpec{"r", 8192 + 128, 16};
    return r;
  }

  std::unique_ptr<Channel> Open() {
    auto ch = Channel::Open(RegionSliceSpec{"r", 0, kChannelFlagBytes}, ctx_,
                            [this](const ChannelProgress& p) {
                              absl::MutexLock lock(&mu_);
                              completed_ = std::max(completed_, p.completed_through);
                              if (p.failed_seq != 0) {
                                failed_seq_ = p.failed_seq;
                                failure_ = p.failure;
                              }
                            });
    EXPECT_TRUE(ch.ok()) << ch.status();
    return ch.ok() ? *std::move(ch) : nullptr;
  }

  // Opens a channel and submits operations 1..ops, which the worker enqueues
  // up to the window (nothing finishes on the recording "device"); null on a
  // failure, reported.
  std::unique_ptr<Channel> OpenWithBacklog(uint64_t ops) {
    std::unique_ptr<Channel> ch = Open();
    if (ch == nullptr) return nullptr;
    for (uint64_t seq = 1; seq <= ops; ++seq) ch->Submit(seq, Request(), nullptr);
    // The window first (however long the worker takes to get there), then
    // 100 ms without a change: it stops there.
    record().EnqueuedAtLeast(kMaxEnqueuedAhead, absl::Seconds(30));
    const uint64_t enqueued = record().SettledEnqueued(absl::Milliseconds(100));
    EXPECT_EQ(enqueued, kMaxEnqueuedAhead) << "the worker stops at the window";
    return enqueued == kMaxEnqueuedAhead ? std::move(ch) : nullptr;
  }

  Record& record() { return recording_.record; }

  uint64_t completed() {
    absl::MutexLock lock(&mu_);
    return completed_;
  }

  RecordingDevice recording_;
  absl::Mutex mu_;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ChannelOpTest, EnqueuesAtMostTheWindowAheadOfTheDevice) {
  constexpr uint64_t kOps = 200;
  std::unique_ptr<Channel> ch = OpenWithBacklog(kOps);
  ASSERT_NE(ch, nullptr);
  Record* q = &record();
  EXPECT_EQ(completed(), 0u);
  // Each round of completions lets it go on, never beyond the window.
  for (int round = 0; round < 100 && q->enqueued() < kOps; ++round) {
    q->CompleteAll();
    q->SettledEnqueued(absl::Milliseconds(20));
  }
  EXPECT_EQ(q->enqueued(), kOps);
  EXPECT_LE(q->max_lead(), kMaxEnqueuedAhead);
  q->CompleteAll();
  ch->Close(absl::Seconds(5));
  EXPECT_EQ(completed(), kOps);
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(failed_seq_, 0u) << failure_;
}

// A client that stopped with work queued behind a ready word: Close (no
// grace) releases the queue, the device drains, and every submitted
// operation is enqueued; the done word is left to the queue.
TEST_F(ChannelOpTest, CloseReleasesAWorkerWaitingForRoom) {
  constexpr uint64_t kOps = 300;
  std::unique_ptr<Channel> ch = OpenWithBacklog(kOps);
  ASSERT_NE(ch, nullptr);
  Record* q = &record();
  ch->Close(absl::ZeroDuration());  // returns: the release drained the queue
  EXPECT_EQ(q->enqueued(), kOps);
  EXPECT_EQ(completed(), kOps);
  EXPECT_TRUE(q->client_released().empty());
}

// A client whose call was cancelled (its process may be dead): the operations
// not yet enqueued are dropped, and the done word is moved past every
// operation before and after the drain, releasing the client's own waits.
TEST_F(ChannelOpTest, CloseForAGoneClientDropsQueuedOpsAndReleasesItsWaits) {
  constexpr uint64_t kOps = 300;
  std::unique_ptr<Channel> ch = OpenWithBacklog(kOps);
  ASSERT_NE(ch, nullptr);
  Record* q = &record();
  ch->Close(absl::Seconds(30), /*client_gone=*/true);  // no grace: returns at once
  // The op the worker held while it waited for room, then nothing more.
  EXPECT_EQ(q->enqueued(), kMaxEnqueuedAhead + 1);
  EXPECT_EQ(completed(), kMaxEnqueuedAhead + 1);
  // First past the unfinished ones, last past all (stored again meanwhile,
  // never lower).
  const std::vector<uint64_t> values = q->client_released();
  ASSERT_GE(values.size(), 2u);
  EXPECT_EQ(values.front(), kChannelFailedOffset + 1);
  EXPECT_EQ(values.back(), kChannelFailedOffset + kMaxEnqueuedAhead + 2);
  EXPECT_TRUE(std::is_sorted(values.begin(), values.end()));
}

// The first releases are written over (the killed client's stream still
// runs): Close stores the release again until the queue drains, instead of
// waiting for good.
TEST_F(ChannelOpTest, CloseReleasesAgainWhatTheClientWroteOver) {
  constexpr uint64_t kOps = 300;
  std::unique_ptr<Channel> ch = OpenWithBacklog(kOps);
  ASSERT_NE(ch, nullptr);
  Record* q = &record();
  q->LoseReleases(3);
  absl::Notification closed;
  std::thread closer([&] {
    ch->Close(absl::ZeroDuration(), /*client_gone=*/true);
    closed.Notify();
  });
  const bool returned = closed.WaitForNotificationWithTimeout(absl::Seconds(10));
  EXPECT_TRUE(returned) << "Close waits for good after " << q->releases() << " releases";
  if (!returned) {
    q->LoseReleases(0);
    while (!closed.WaitForNotificationWithTimeout(absl::Milliseconds(5))) q->CompleteAll();
  }
  closer.join();
  EXPECT_GE(q->releases(), 4);
  EXPECT_EQ(q->enqueued(), kMaxEnqueuedAhead + 1);
  EXPECT_EQ(completed(), kMaxEnqueuedAhead + 1);
}

// A device that does not drain even once released: Close keeps waiting for
// the worker, and says every kCloseReportEvery what the worker and the queue
// wait on, from counters and host words alone.
TEST_F(ChannelOpTest, CloseReportsAWorkerThatDoesNotReturn) {
  constexpr uint64_t kOps = 300;
  std::unique_ptr<Channel> ch = OpenWithBacklog(kOps);
  ASSERT_NE(ch, nullptr);
  Record* q = &record();
  q->StallDevice();
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  sink->set_pattern("%v");
  spdlog::default_logger()->sinks().push_back(sink);
  absl::Notification closed;
  std::thread closer([&] {
    ch->Close(absl::ZeroDuration(), /*client_gone=*/true);
    closed.Notify();
  });
  std::string report;
  for (const absl::Time deadline = absl::Now() + kCloseReportEvery * 5;
       report.empty() && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(20));
    for (const std::string& line : sink->last_formatted()) {
      if (absl::StrContains(line, "event=channel_close_slow")) report = line;
    }
  }
  EXPECT_FALSE(closed.HasBeenNotified()) << "Close returned although nothing drained";
  // The device finishes: the worker returns and Close with it.
  while (!closed.WaitForNotificationWithTimeout(absl::Milliseconds(5))) q->CompleteAll();
  closer.join();
  auto& sinks = spdlog::default_logger()->sinks();
  sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
  EXPECT_TRUE(absl::StrContains(report, "worker=wait_for_room")) << report;
  EXPECT_TRUE(absl::StrContains(report, "submitted=300 enqueued_through=32 completed_through=0"))
      << report;
  EXPECT_TRUE(absl::StrContains(report, "queue=\"recorded_enqueued=32 recorded_completed=0\""))
      << report;
  EXPECT_EQ(q->enqueued(), kMaxEnqueuedAhead + 1);
}

}  // namespace
}  // namespace qtx::server::ops

#include "server/api/executor.h"

#include <utility>

namespace qtx::server::api {

Executor::Executor(int threads, size_t max_queued) : max_queued_(max_queued) {
  {
    absl::MutexLock lock(&mu_);
    busy_since_.assign(static_cast<size_t>(threads), absl::InfiniteFuture());
  }
  absl::MutexLock lock(&join_mu_);
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(static_cast<size_t>(i)); });
  }
}

Executor::~Executor() { Shutdown(); }

bool Executor::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || queue_.size() >= max_queued_) return false;
  queue_.push_back(std::move(task));
  return true;
}

size_t Executor::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

bool Executor::AllWorkersBusySince(absl::Time t) const {
  absl::MutexLock lock(&mu_);
  if (stopping_ || busy_since_.empty()) return false;
  for (absl::Time since : busy_since_) {
    if (since == absl::InfiniteFuture() || since > t) return false;  // idle, or busy since after t
  }
  return true;
}

void Executor::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  absl::MutexLock lock(&join_mu_);
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
  workers_.clear();
}

void Executor::WorkerLoop(size_t index) {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      busy_since_[index] = absl::InfiniteFuture();
      mu_.Await(absl::Condition(
          +[](Executor* e)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) { return e->stopping_ || !e->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_since_[index] = absl::Now();
    }
    task();
  }
}

bool InlineSlots::TryAcquire() {
  int used = used_.load(std::memory_order_relaxed);
  while (used < max_) {
    if (used_.compare_exchange_weak(used, used + 1, std::memory_order_acquire,
                                    std::memory_order_relaxed)) {
      runs_.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

void InlineSlots::Release() { used_.fetch_sub(1, std::memory_order_release); }

}  // namespace qtx::server::api

// Executor: a fixed pool of worker threads with a bounded FIFO queue. gRPC
// reactions hand their long work here so that they never block; each task
// calls Finish on its reactor when done. Short work runs on the reaction
// thread itself, bounded by InlineSlots (below).
//
// Thread safety: Submit and Shutdown are safe for concurrent use.
#ifndef QTX_SERVER_API_EXECUTOR_H_
#define QTX_SERVER_API_EXECUTOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace qtx::server::api {

class Executor {
 public:
  // REQUIRES: threads >= 1.
  Executor(int threads, size_t max_queued);
  // Shuts down (runs what is queued, joins the workers).
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task`. Returns false (and drops `task`) when shut down or when
  // max_queued tasks are already waiting; the caller must then answer the
  // request itself.
  bool Submit(std::function<void()> task);

  // Stops accepting tasks, runs every queued task, joins the workers.
  // Idempotent.
  void Shutdown();

  size_t queued() const;

  // True when every worker has been running one task since `t` or earlier
  // (none idle, none between tasks): with `t` = now - a stall bound, the pool
  // is wedged and queued work may never run (QtxServer then reports
  // NOT_SERVING). False after Shutdown.
  bool AllWorkersBusySince(absl::Time t) const;

 private:
  void WorkerLoop(size_t index);

  // Constant after construction.
  const size_t max_queued_;

  // State below is protected by mu_.
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Per worker: when its current task started; InfiniteFuture while idle.
  std::vector<absl::Time> busy_since_ ABSL_GUARDED_BY(mu_);

  // Used by the constructing thread and Shutdown (serialized by join_mu_).
  absl::Mutex join_mu_;
  std::vector<std::thread> workers_ ABSL_GUARDED_BY(join_mu_);
};

// InlineSlots: how many short requests may run at once on gRPC's own threads
// (the thread that received the call) instead of going to the Executor. A
// short request saves the hand-off to a worker and back (bench/README.md,
// rpc_overhead_bench); the bound keeps a burst of them from occupying every
// thread that polls the sockets.
//
// Thread safety: safe for concurrent use.
class InlineSlots {
 public:
  // max_concurrent == 0: never run inline. REQUIRES: max_concurrent >= 0.
  explicit InlineSlots(int max_concurrent) : max_(max_concurrent) {}
  InlineSlots(const InlineSlots&) = delete;
  InlineSlots& operator=(const InlineSlots&) = delete;

  // Takes a slot: true if fewer than max_concurrent are taken. The caller
  // must Release it when done.
  bool TryAcquire();
  void Release();

  // Requests that ran inline since construction.
  uint64_t runs() const { return runs_.load(std::memory_order_relaxed); }
  int max_concurrent() const { return max_; }

 private:
  const int max_;
  std::atomic<int> used_{0};
  std::atomic<uint64_t> runs_{0};
};

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_EXECUTOR_H_

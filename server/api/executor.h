// Executor: a fixed pool of worker threads with a bounded FIFO queue. gRPC
// reactions hand their work here so that they never block; each task calls
// Finish on its reactor when done.
//
// Thread safety: Submit and Shutdown are safe for concurrent use.
#ifndef QTX_SERVER_API_EXECUTOR_H_
#define QTX_SERVER_API_EXECUTOR_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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

 private:
  void WorkerLoop();

  // Constant after construction.
  const size_t max_queued_;

  // State below is protected by mu_.
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  // Used by the constructing thread and Shutdown (serialized by join_mu_).
  absl::Mutex join_mu_;
  std::vector<std::thread> workers_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_EXECUTOR_H_

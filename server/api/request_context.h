// Per-request bookkeeping shared by the handlers: the request id (the
// client's "x-request-id" metadata when it is well-formed, else generated),
// echoed back in the initial metadata, and the one log line per request.
// Also RunOnExecutor, which moves a handler's work off the reaction thread,
// and RunShortInline, which keeps short work on it.
#ifndef QTX_SERVER_API_REQUEST_CONTEXT_H_
#define QTX_SERVER_API_REQUEST_CONTEXT_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/api/executor.h"

namespace qtx::server::api {

inline constexpr std::string_view kRequestIdHeader = "x-request-id";

// A fresh id: 16 hex digits, unique within the process with overwhelming
// probability. Thread-safe.
std::string NewRequestId();

// The client's x-request-id if it is 1..64 chars of [A-Za-z0-9_.:-], else a
// new one.
std::string RequestIdFor(const grpc::CallbackServerContext& context);

struct RequestLog {
  std::string request_id;
  std::string method;
  absl::Time start;
};

// Reads the request id, echoes it to the client, logs the start at debug.
RequestLog StartRequest(grpc::CallbackServerContext* context, std::string_view method);

// Logs the end of a request (OK at info; failures once via ToGrpcStatus) and
// returns the status to finish with.
grpc::Status EndRequest(const RequestLog& log, const absl::Status& status);

// Runs `work` (absl::Status()) on `executor`, then finishes the call with its
// status. Never blocks the calling reaction. If the executor refuses the
// task, finishes at once with UNAVAILABLE. A call cancelled before its work
// starts finishes CANCELLED without running it.
template <typename Work>
grpc::ServerUnaryReactor* RunOnExecutor(grpc::CallbackServerContext* context,
                                        std::string_view method, Executor* executor, Work work) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RequestLog log = StartRequest(context, method);
  auto task = [context, reactor, log, work = std::move(work)]() mutable {
    absl::Status status = context->IsCancelled()
                              ? absl::CancelledError("the call was cancelled before it started")
                              : work();
    reactor->Finish(EndRequest(log, status));
  };
  RequestLog refused_log = log;
  if (!executor->Submit(std::move(task))) {
    reactor->Finish(EndRequest(
        refused_log, absl::UnavailableError(
                         "the server is shutting down or all workers are busy; retry later")));
  }
  return reactor;
}

// Runs `work` right here, on the reaction thread, when `is_short` (the op's
// host work is bounded: server/ops *RunsShort) and `slots` has a free slot;
// otherwise exactly as RunOnExecutor. Inline work sees the same request id,
// log line, cancellation check and status mapping; it only skips the
// hand-off to a worker thread and back.
template <typename Work>
grpc::ServerUnaryReactor* RunShortInline(grpc::CallbackServerContext* context,
                                         std::string_view method, Executor* executor,
                                         InlineSlots* slots, bool is_short, Work work) {
  if (!is_short || !slots->TryAcquire()) {
    return RunOnExecutor(context, method, executor, std::move(work));
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const RequestLog log = StartRequest(context, method);
  const absl::Status status = context->IsCancelled()
                                  ? absl::CancelledError("the call was cancelled before it started")
                                  : work();
  slots->Release();
  reactor->Finish(EndRequest(log, status));
  return reactor;
}

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_REQUEST_CONTEXT_H_

// Makes gRPC's completion-queue hand-off visible to ThreadSanitizer
// (QTX_TSAN=ON builds only; linked into every executable with
// tsan_absl_shim.cc).
//
// gRPC's contract: whatever a thread did before handing a tag to gRPC core
// (grpc_call_start_batch, grpc_server_request_call / _registered_call)
// happens before the thread that gets that tag back from the completion queue
// (grpc_completion_queue_next / _pluck) runs its completion. Core is not
// instrumented and part of that path is lock-free, so TSan misses the edge and
// reports, e.g., qtx filling a response on an executor thread and gRPC
// destroying it after the Finish batch completed on another thread. These
// definitions (exported from the executable, so they interpose libgrpc++'s
// calls too) add exactly that edge: release on the tag before the real call,
// acquire on the tag of a completed event after it. Nothing else.
//
// One more edge of the callback API: a server call's OnDone runs once its
// count of outstanding reactions (an acq_rel atomic) drops to zero. gRPC's
// headers decrement it in qtx's (instrumented) code, libgrpc++ in its own
// (not instrumented) code; when the last decrement is libgrpc++'s, TSan misses
// its acquire. ServerCallbackCall::ScheduleOnDone (libgrpc++, called through
// the PLT) is what the last decrementer calls: it acquires the counter there.
//
// Covers callback-API completions as gRPC 1.51 runs them here: libgrpc++'s
// "nexting" threads take events with grpc_completion_queue_next and run the
// functor. A core callback queue that runs functors itself (no _next) would
// not get the acquire; then the reports come back, they are not hidden.
#include <dlfcn.h>
#include <grpc/grpc.h>
#include <grpcpp/support/server_callback.h>
#include <sanitizer/tsan_interface.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#if !defined(__has_feature)
#error "tsan_grpc_shim.cc needs clang"
#elif !__has_feature(thread_sanitizer)
#error "tsan_grpc_shim.cc is only for -fsanitize=thread builds (QTX_TSAN=ON)"
#endif

namespace {

// Tags are the addresses of gRPC's / the caller's tag objects; small integers
// (some callers' sentinels) are not memory TSan can attach a clock to.
bool IsAddress(const void* tag) { return reinterpret_cast<uintptr_t>(tag) >= 65536; }

void Release(void* tag) {
  if (IsAddress(tag)) __tsan_release(tag);
}

template <typename Fn>
Fn Real(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_grpc_shim: %s not found after the executable: %s\n", name,
                 dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(p);
}

grpc_event Acquired(grpc_event ev) {
  if (ev.type == GRPC_OP_COMPLETE && IsAddress(ev.tag)) __tsan_acquire(ev.tag);
  return ev;
}

}  // namespace

extern "C" {

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag,
                                      void* reserved) {
  static const auto real = Real<decltype(&grpc_call_start_batch)>("grpc_call_start_batch");
  Release(tag);
  return real(call, ops, nops, tag, reserved);
}

grpc_call_error grpc_server_request_call(grpc_server* server, grpc_call** call,
                                         grpc_call_details* details,
                                         grpc_metadata_array* request_metadata,
                                         grpc_completion_queue* cq_bound_to_call,
                                         grpc_completion_queue* cq_for_notification,
                                         void* tag_new) {
  static const auto real = Real<decltype(&grpc_server_request_call)>("grpc_server_request_call");
  Release(tag_new);
  return real(server, call, details, request_metadata, cq_bound_to_call, cq_for_notification,
              tag_new);
}

grpc_call_error grpc_server_request_registered_call(grpc_server* server, void* registered_method,
                                                    grpc_call** call, gpr_timespec* deadline,
                                                    grpc_metadata_array* request_metadata,
                                                    grpc_byte_buffer** optional_payload,
                                                    grpc_completion_queue* cq_bound_to_call,
                                                    grpc_completion_queue* cq_for_notification,
                                                    void* tag_new) {
  static const auto real =
      Real<decltype(&grpc_server_request_registered_call)>("grpc_server_request_registered_call");
  Release(tag_new);
  return real(server, registered_method, call, deadline, request_metadata, optional_payload,
              cq_bound_to_call, cq_for_notification, tag_new);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline,
                                      void* reserved) {
  static const auto real =
      Real<decltype(&grpc_completion_queue_next)>("grpc_completion_queue_next");
  return Acquired(real(cq, deadline, reserved));
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag, gpr_timespec deadline,
                                       void* reserved) {
  static const auto real =
      Real<decltype(&grpc_completion_queue_pluck)>("grpc_completion_queue_pluck");
  return Acquired(real(cq, tag, deadline, reserved));
}

}  // extern "C"

namespace grpc::internal {

// Layout in gRPC 1.51: vptr, atomic_int on_cancel_conditions_remaining_,
// atomic_int callbacks_outstanding_.
static_assert(sizeof(ServerCallbackCall) == sizeof(void*) + 2 * sizeof(std::atomic_int),
              "ServerCallbackCall layout changed: revisit the counter's offset");

void ServerCallbackCall::ScheduleOnDone(bool inline_ondone) {
  using Fn = void (*)(ServerCallbackCall*, bool);
  static const auto real = Real<Fn>("_ZN4grpc8internal18ServerCallbackCall14ScheduleOnDoneEb");
  __tsan_acquire(reinterpret_cast<char*>(this) + sizeof(void*) + sizeof(std::atomic_int));
  real(this, inline_ondone);
}

}  // namespace grpc::internal

// Makes qtx's absl::Mutex / absl::CondVar / absl::Notification use visible to
// ThreadSanitizer (QTX_TSAN=ON builds only; CMakeLists.txt links this object
// into every executable of such a build).
//
// Why: Debian's libabsl is not built with -fsanitize=thread. Its Mutex is
// atomics plus futex inside an uninstrumented library, so TSan sees neither
// the acquire nor the release and reports every access to state guarded by an
// absl::Mutex as a race. Rebuilding Abseil (and gRPC, which shares it) is not
// an option on CI, so this file defines the out-of-line members that qtx
// calls (Mutex::Lock, Unlock, Await, LockWhen..., CondVar::Wait...,
// Notification::Notify / WaitForNotification...) in the executable itself.
// Each one tells TSan what the real one does, through the public annotation
// API of <sanitizer/tsan_interface.h>, and forwards to the real symbol in
// libabsl_synchronization.so (dlsym(RTLD_NEXT)). The locking itself is
// untouched: the real Mutex still does all of it.
//
// Scope: the definitions are exported from the executable, so they also
// interpose the calls that gRPC and Abseil themselves make through the PLT
// (gRPC's grpc_core::Mutex / CondVar are absl::Mutex / CondVar): the hand-offs
// between gRPC's threads that go through a mutex become visible too, which is
// what keeps gRPC's callback machinery from showing up as races in the
// (instrumented) grpcpp and protobuf code that qtx compiles. The real
// functions call each other through the PLT as well (WaitWithTimeout calls
// WaitWithDeadline, Notify calls Lock...): a call made from inside a real
// function is forwarded without annotating it again.
//
// The model, per operation (m = the mutex, f = read-lock flag if held shared):
//   Lock / ReaderLock / LockWhen*      pre_lock(m)  real  post_lock(m)
//   TryLock / ReaderTryLock            same, post_lock says whether it failed
//   Unlock / ReaderUnlock              pre_unlock(m)  real  post_unlock(m)
//   Await*(cond), CondVar::Wait*(m)    unlock(m)  real  lock(m): both release
//                                      the mutex while they wait, and always
//                                      return with it held again
//   Notification::Notify               release before the real Notify
//   Notification::WaitFor*             acquire after a true return
// Between a pre_* and its post_* TSan ignores the thread's memory accesses
// (that is TSan's contract for the real lock code), so the predicates of
// absl::Condition, which the real Mutex evaluates inside those calls with the
// mutex really held, are not checked. Everything else is.
//
// absl::Barrier and absl::BlockingCounter are covered through the Lock /
// Await calls they make. Not covered: absl::base_internal::SpinLock (Abseil
// internal; qtx does not use it). A missing release/acquire shows up as a
// (false) race report, never as a silenced one, and the canary in
// tests/robustness/tsan_canary.cc keeps the setup honest both ways.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#if !defined(__has_feature)
#error "tsan_absl_shim.cc needs clang"
#elif !__has_feature(thread_sanitizer)
#error "tsan_absl_shim.cc is only for -fsanitize=thread builds (QTX_TSAN=ON)"
#endif

#include "absl/base/config.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define QTX_STR2(x) #x
#define QTX_STR(x) QTX_STR2(x)

// Itanium mangling of "absl::<inline namespace>::" + `rest` (`rest` is the
// mangled tail, e.g. "5Mutex4LockEv"); `prefix` is "_ZN" or "_ZNK" (const).
std::string Mangle(const char* prefix, const char* rest) {
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const char* ns = QTX_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return std::string(prefix) + "4absl" + std::to_string(std::strlen(ns)) + ns + rest;
#else
  return std::string(prefix) + "4absl" + rest;
#endif
}

// The real function, looked up once. Aborts with the symbol's name if
// libabsl_synchronization does not export it (an Abseil whose API moved).
template <typename Fn>
Fn Real(const char* prefix, const char* rest) {
  const std::string name = Mangle(prefix, rest);
  void* p = dlsym(RTLD_NEXT, name.c_str());
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found after the executable: %s\n", name.c_str(),
                 dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(p);
}

#define QTX_REAL(type, prefix, rest)                 \
  static const auto real = Real<type>(prefix, rest); \
  static_assert(true)

// Mutexes this thread holds in shared (reader) mode: Await and CondVar::Wait
// must release them with the read flag. Small and fixed: qtx does not nest
// reader locks deeply.
constexpr int kMaxReaderHeld = 16;
thread_local const void* reader_held[kMaxReaderHeld];
thread_local int reader_held_count = 0;

void PushReader(const void* m) {
  if (reader_held_count == kMaxReaderHeld) {
    std::fprintf(stderr, "tsan_absl_shim: more than %d reader locks held by one thread\n",
                 kMaxReaderHeld);
    std::abort();
  }
  reader_held[reader_held_count++] = m;
}

void PopReader(const void* m) {
  for (int i = reader_held_count - 1; i >= 0; --i) {
    if (reader_held[i] == m) {
      reader_held[i] = reader_held[--reader_held_count];
      return;
    }
  }
}

unsigned HeldFlags(const void* m) {
  for (int i = 0; i < reader_held_count; ++i) {
    if (reader_held[i] == m) return __tsan_mutex_read_lock;
  }
  return 0;
}

// >0 while this thread is inside a real function called from here.
thread_local int in_real = 0;

// Calls real(args...) with in_real raised.
template <typename Fn, typename... Args>
auto CallReal(Fn real, Args&&... args) {
  struct Guard {
    Guard() { ++in_real; }
    ~Guard() { --in_real; }
  } guard;
  return real(std::forward<Args>(args)...);
}

void AnnotateLock(void* m, unsigned flags) {
  __tsan_mutex_pre_lock(m, flags);
  __tsan_mutex_post_lock(m, flags, 0);
}

// Runs `wait` (which releases m while it blocks and returns with m held again
// in the same mode) as an unlock followed by a lock of m.
template <typename F>
auto AsUnlockThenLock(absl::Mutex* m, F wait) {
  const unsigned flags = HeldFlags(m);
  __tsan_mutex_pre_unlock(m, flags);
  auto r = wait();
  __tsan_mutex_post_unlock(m, flags);
  AnnotateLock(m, flags);
  return r;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

Mutex::~Mutex() {
  QTX_REAL(void (*)(Mutex*), "_ZN", "5MutexD1Ev");
  __tsan_mutex_destroy(this, __tsan_mutex_not_static);
  CallReal(real, this);
}

void Mutex::Lock() {
  QTX_REAL(void (*)(Mutex*), "_ZN", "5Mutex4LockEv");
  if (in_real > 0) return real(this);
  __tsan_mutex_pre_lock(this, 0);
  CallReal(real, this);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::ReaderLock() {
  QTX_REAL(void (*)(Mutex*), "_ZN", "5Mutex10ReaderLockEv");
  if (in_real > 0) return real(this);
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  CallReal(real, this);
  __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
  PushReader(this);
}

bool Mutex::TryLock() {
  QTX_REAL(bool (*)(Mutex*), "_ZN", "5Mutex7TryLockEv");
  if (in_real > 0) return real(this);
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_lock);
  const bool ok = CallReal(real, this);
  __tsan_mutex_post_lock(this, __tsan_mutex_try_lock | (ok ? 0 : __tsan_mutex_try_lock_failed), 0);
  return ok;
}

bool Mutex::ReaderTryLock() {
  QTX_REAL(bool (*)(Mutex*), "_ZN", "5Mutex13ReaderTryLockEv");
  if (in_real > 0) return real(this);
  const unsigned flags = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  __tsan_mutex_pre_lock(this, flags);
  const bool ok = CallReal(real, this);
  __tsan_mutex_post_lock(this, flags | (ok ? 0 : __tsan_mutex_try_lock_failed), 0);
  if (ok) PushReader(this);
  return ok;
}

void Mutex::Unlock() {
  QTX_REAL(void (*)(Mutex*), "_ZN", "5Mutex6UnlockEv");
  if (in_real > 0) return real(this);
  __tsan_mutex_pre_unlock(this, 0);
  CallReal(real, this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::ReaderUnlock() {
  QTX_REAL(void (*)(Mutex*), "_ZN", "5Mutex12ReaderUnlockEv");
  if (in_real > 0) return real(this);
  PopReader(this);
  __tsan_mutex_pre_unlock(this, __tsan_mutex_read_lock);
  CallReal(real, this);
  __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
}

void Mutex::LockWhen(const Condition& cond) {
  QTX_REAL(void (*)(Mutex*, const Condition&), "_ZN", "5Mutex8LockWhenERKNS0_9ConditionE");
  if (in_real > 0) return real(this, cond);
  __tsan_mutex_pre_lock(this, 0);
  CallReal(real, this, cond);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  QTX_REAL(void (*)(Mutex*, const Condition&), "_ZN", "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  if (in_real > 0) return real(this, cond);
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  CallReal(real, this, cond);
  __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
  PushReader(this);
}

// The *WithTimeout / *WithDeadline forms return whether cond held; the mutex
// is acquired either way.
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  QTX_REAL(bool (*)(Mutex*, const Condition&, Duration), "_ZN",
           "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  if (in_real > 0) return real(this, cond, timeout);
  __tsan_mutex_pre_lock(this, 0);
  const bool r = CallReal(real, this, cond, timeout);
  __tsan_mutex_post_lock(this, 0, 0);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  QTX_REAL(bool (*)(Mutex*, const Condition&, Time), "_ZN",
           "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  if (in_real > 0) return real(this, cond, deadline);
  __tsan_mutex_pre_lock(this, 0);
  const bool r = CallReal(real, this, cond, deadline);
  __tsan_mutex_post_lock(this, 0, 0);
  return r;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  QTX_REAL(bool (*)(Mutex*, const Condition&, Duration), "_ZN",
           "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  if (in_real > 0) return real(this, cond, timeout);
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  const bool r = CallReal(real, this, cond, timeout);
  __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
  PushReader(this);
  return r;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  QTX_REAL(bool (*)(Mutex*, const Condition&, Time), "_ZN",
           "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  if (in_real > 0) return real(this, cond, deadline);
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  const bool r = CallReal(real, this, cond, deadline);
  __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
  PushReader(this);
  return r;
}

void Mutex::Await(const Condition& cond) {
  QTX_REAL(void (*)(Mutex*, const Condition&), "_ZN", "5Mutex5AwaitERKNS0_9ConditionE");
  if (in_real > 0) return real(this, cond);
  AsUnlockThenLock(this, [&] {
    CallReal(real, this, cond);
    return 0;
  });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  QTX_REAL(bool (*)(Mutex*, const Condition&, Duration), "_ZN",
           "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  if (in_real > 0) return real(this, cond, timeout);
  return AsUnlockThenLock(this, [&] { return CallReal(real, this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  QTX_REAL(bool (*)(Mutex*, const Condition&, Time), "_ZN",
           "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  if (in_real > 0) return real(this, cond, deadline);
  return AsUnlockThenLock(this, [&] { return CallReal(real, this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  QTX_REAL(void (*)(CondVar*, Mutex*), "_ZN", "7CondVar4WaitEPNS0_5MutexE");
  if (in_real > 0) return real(this, mu);
  AsUnlockThenLock(mu, [&] {
    CallReal(real, this, mu);
    return 0;
  });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  QTX_REAL(bool (*)(CondVar*, Mutex*, Duration), "_ZN",
           "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  if (in_real > 0) return real(this, mu, timeout);
  return AsUnlockThenLock(mu, [&] { return CallReal(real, this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  QTX_REAL(bool (*)(CondVar*, Mutex*, Time), "_ZN",
           "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  if (in_real > 0) return real(this, mu, deadline);
  return AsUnlockThenLock(mu, [&] { return CallReal(real, this, mu, deadline); });
}

// ReleasableMutexLock's constructor and destructor are inline (they call the
// Lock/Unlock above); Release() is out of line and unlocks inside libabsl.
void ReleasableMutexLock::Release() {
  QTX_REAL(void (*)(ReleasableMutexLock*), "_ZN", "19ReleasableMutexLock7ReleaseEv");
  if (in_real > 0) return real(this);
  static_assert(sizeof(ReleasableMutexLock) == sizeof(Mutex*), "layout: one Mutex* mu_");
  Mutex* mu = *reinterpret_cast<Mutex**>(this);
  __tsan_mutex_pre_unlock(mu, 0);
  CallReal(real, this);
  __tsan_mutex_post_unlock(mu, 0);
}

// Notify and WaitFor* release/acquire on the address of notified_yet_, the
// atomic<bool> after the Mutex: HasBeenNotified() is inline, an instrumented
// acquire load of that atomic, so a true HasBeenNotified() synchronizes too.
static_assert(sizeof(Notification) == 2 * sizeof(Mutex) && alignof(Mutex) == sizeof(Mutex),
              "layout: Mutex mutex_; std::atomic<bool> notified_yet_;");
static void* NotifiedYet(const Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n)) + sizeof(Mutex);
}

void Notification::Notify() {
  QTX_REAL(void (*)(Notification*), "_ZN", "12Notification6NotifyEv");
  if (in_real > 0) return real(this);
  __tsan_release(NotifiedYet(this));
  CallReal(real, this);
}

void Notification::WaitForNotification() const {
  QTX_REAL(void (*)(const Notification*), "_ZNK", "12Notification19WaitForNotificationEv");
  if (in_real > 0) return real(this);
  CallReal(real, this);
  __tsan_acquire(NotifiedYet(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  QTX_REAL(bool (*)(const Notification*, Duration), "_ZNK",
           "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  if (in_real > 0) return real(this, timeout);
  const bool r = CallReal(real, this, timeout);
  if (r) __tsan_acquire(NotifiedYet(this));
  return r;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  QTX_REAL(bool (*)(const Notification*, Time), "_ZNK",
           "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  if (in_real > 0) return real(this, deadline);
  const bool r = CallReal(real, this, deadline);
  if (r) __tsan_acquire(NotifiedYet(this));
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl

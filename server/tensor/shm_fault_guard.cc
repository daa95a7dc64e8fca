#include "server/tensor/shm_fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/base/const_init.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace qtx::server::tensor {
namespace {

// One watched range. `begin` != 0 marks a live entry; it is published last
// (release) by Watch and cleared first by Unwatch, so the handler, which
// loads it with acquire, never pairs a live begin with a stale end.
struct Range {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
  bool used = false;  // under Mutex()
};

Range g_ranges[ShmFaultGuard::kMaxRanges];
std::atomic<int> g_high_water{0};  // entries [0, g_high_water) may be live
std::atomic<uint64_t> g_faults{0};
uintptr_t g_page = 4096;
struct sigaction g_previous;  // written once, before the handler is installed

ABSL_CONST_INIT absl::Mutex g_mu(absl::kConstInit);
absl::Mutex& Mutex() { return g_mu; }

// The default action for a SIGBUS that is not ours: what would have happened
// without the guard.
void ForwardToPrevious(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it and re-raise. SIGBUS is blocked while this
  // handler runs, so the raised signal is delivered (and kills the process)
  // as soon as the handler returns; a hardware fault would also recur.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
  ::raise(SIGBUS);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const auto addr = reinterpret_cast<uintptr_t>(info != nullptr ? info->si_addr : nullptr);
  // A fault raised by the kernel (si_code > 0), not a signal sent by kill().
  if (info != nullptr && info->si_code > 0 && addr != 0) {
    const int n = g_high_water.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      Range& r = g_ranges[i];
      const uintptr_t begin = r.begin.load(std::memory_order_acquire);
      if (begin == 0 || addr < begin) continue;
      const uintptr_t end = r.end.load(std::memory_order_relaxed);
      if (addr >= end) continue;
      // The object shrank below this page: every page from here to the end
      // of the mapping is past it (a truncation cuts the tail).
      const uintptr_t page = addr & ~(g_page - 1);
      void* replaced = ::mmap(reinterpret_cast<void*>(page), end - page, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (replaced == MAP_FAILED) break;  // cannot repair: behave as without the guard
      r.faulted.store(true, std::memory_order_release);
      g_faults.fetch_add(1, std::memory_order_relaxed);
      errno = saved_errno;
      return;  // the faulting access is retried on the zero pages
    }
  }
  errno = saved_errno;
  ForwardToPrevious(sig, info, context);
}

absl::Status InstallOnce() {
  static const absl::Status installed = [] {
    const long page = ::sysconf(_SC_PAGESIZE);
    if (page > 0) g_page = static_cast<uintptr_t>(page);
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &g_previous) != 0) {
      return absl::InternalError(absl::StrFormat(
          "cannot install the SIGBUS guard for shm regions: %s", std::strerror(errno)));
    }
    return absl::OkStatus();
  }();
  return installed;
}

}  // namespace

absl::StatusOr<int> ShmFaultGuard::Watch(void* base, size_t length) {
  if (absl::Status s = InstallOnce(); !s.ok()) return s;
  const auto begin = reinterpret_cast<uintptr_t>(base);
  if (begin == 0 || length == 0 || begin % g_page != 0) {
    return absl::InternalError("ShmFaultGuard::Watch: a range must be a whole, non-empty mapping");
  }
  const uintptr_t end = begin + (length + g_page - 1) / g_page * g_page;
  absl::MutexLock lock(&Mutex());
  for (int i = 0; i < kMaxRanges; ++i) {
    Range& r = g_ranges[i];
    if (r.used) continue;
    r.used = true;
    r.faulted.store(false, std::memory_order_relaxed);
    r.end.store(end, std::memory_order_relaxed);
    r.begin.store(begin, std::memory_order_release);
    if (g_high_water.load(std::memory_order_relaxed) <= i) {
      g_high_water.store(i + 1, std::memory_order_release);
    }
    return i;
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "more than %d shared-memory mappings are registered; unregister some regions", kMaxRanges));
}

void ShmFaultGuard::Unwatch(int id) {
  if (id < 0 || id >= kMaxRanges) return;
  absl::MutexLock lock(&Mutex());
  Range& r = g_ranges[id];
  r.begin.store(0, std::memory_order_release);
  r.end.store(0, std::memory_order_relaxed);
  r.used = false;
}

bool ShmFaultGuard::Faulted(int id) {
  if (id < 0 || id >= kMaxRanges) return false;
  return g_ranges[id].faulted.load(std::memory_order_acquire);
}

uint64_t ShmFaultGuard::faults_total() { return g_faults.load(std::memory_order_relaxed); }

}  // namespace qtx::server::tensor

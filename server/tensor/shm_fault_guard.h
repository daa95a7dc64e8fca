// ShmFaultGuard: a client must not be able to kill qtxd by truncating a
// shared-memory object that qtxd has mapped (a registered shm region). Reading
// or writing a mapped page past the object's new end raises SIGBUS, which
// kills the process by default, whichever thread (a handler, an OpenMP
// worker, a collective's thread) touched it.
//
// The guard installs one process-wide SIGBUS handler. Every shm mapping is
// "watched": when a SIGBUS hits a watched range, the handler replaces the
// range from the faulting page to its end with private zero pages
// (mmap MAP_FIXED | MAP_ANONYMOUS), marks the range as faulted and returns,
// so the faulting access is retried on memory that exists. The request goes
// on with zeros where the client's bytes were and must not be trusted: every
// op checks its regions when it ends (Region::Intact) and fails with
// DATA_LOSS, and the region refuses every later pin until it is registered
// again (its mapping no longer shows the client's object). A SIGBUS outside
// every watched range goes to the handler that was installed before (or the
// default action), as if the guard did not exist.
//
// Async-signal safety: the handler only reads atomics, calls mmap (a system
// call) and writes atomics. Watch/Unwatch take a mutex and never run in the
// handler.
#ifndef QTX_SERVER_TENSOR_SHM_FAULT_GUARD_H_
#define QTX_SERVER_TENSOR_SHM_FAULT_GUARD_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace qtx::server::tensor {

class ShmFaultGuard {
 public:
  // How many ranges may be watched at once (RESOURCE_EXHAUSTED past it).
  static constexpr int kMaxRanges = 16384;

  // Installs the handler once per process (later calls do nothing) and
  // watches [base, base + length), a whole mapping (base page-aligned).
  // Returns a watch id for Faulted/Unwatch.
  static absl::StatusOr<int> Watch(void* base, size_t length);
  // Stops watching (before the range is unmapped). Safe to call once per id.
  static void Unwatch(int id);
  // True once a SIGBUS hit the watched range `id`.
  static bool Faulted(int id);
  // SIGBUS faults absorbed since the process started (for metrics and tests).
  static uint64_t faults_total();
};

}  // namespace qtx::server::tensor

#endif  // QTX_SERVER_TENSOR_SHM_FAULT_GUARD_H_

// Mapped memory: where a region's bytes live (MemoryKind), the memory opened
// for a region (MappedMemory) and the hooks a CUDA device supplies to open
// CUDA IPC and VMM memory. Plain types, shared by the region table
// (region_table.h), the Device and the Communicator, which need no more of
// the table than these.
#ifndef QTX_SERVER_TENSOR_MAPPED_MEMORY_H_
#define QTX_SERVER_TENSOR_MAPPED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace qtx::server::tensor {

// Where a region's bytes live: host memory the CPU can touch, or device memory.
enum class MemoryKind { kHost, kDevice };

// Memory opened for a region: the usable range and how to release it.
struct MappedMemory {
  std::byte* data = nullptr;      // start of the registered range
  std::function<void()> release;  // called once when the region is destroyed
  // Optional, called on every pin (RegionTable::Acquire): a non-OK status
  // refuses the pin (e.g. a shm object shrunk below the mapped range, which
  // would fault on access).
  std::function<absl::Status()> check;
  // Optional: true once the memory lost pages while mapped (a shm object
  // truncated under a request; see shm_fault_guard.h). Must be cheap.
  std::function<bool()> faulted;
};

// Opens a CUDA IPC handle (64 bytes) on `device_id`, `byte_size` bytes.
// Supplied by a CUDA device; absent in a CPU-only server.
using CudaIpcOpener = std::function<absl::StatusOr<MappedMemory>(
    std::string_view ipc_handle, int32_t device_id, uint64_t byte_size)>;

// Imports cuMemCreate chunks from POSIX fd handles (`fds[i]`, `chunk_sizes[i]`
// bytes each, borrowed: the caller closes them), maps them one after another
// in one reserved range and returns [offset, offset + byte_size) of it on
// `device_id`. Supplied by a CUDA device.
using CudaVmmOpener = std::function<absl::StatusOr<MappedMemory>(
    std::span<const int> fds, std::span<const uint64_t> chunk_sizes, int32_t device_id,
    uint64_t offset, uint64_t byte_size)>;

// The ordinal (in this process) of the GPU with a 16-byte UUID; NOT_FOUND
// when no visible GPU has it. Supplied by a CUDA device.
using CudaUuidResolver = std::function<absl::StatusOr<int32_t>(std::string_view uuid)>;

}  // namespace qtx::server::tensor

#endif  // QTX_SERVER_TENSOR_MAPPED_MEMORY_H_

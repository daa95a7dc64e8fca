// qtx_client_cuda: helpers that turn a client's own CUDA objects into what
// qtx::Client passes to a CUDA sidecar -- device memory as a CUDA IPC region,
// and interprocess events for stream ordering without host round trips.
//
//   void* buf;  cudaMalloc(&buf, bytes);
//   QTX_CHECK_OK(qtx::cuda::RegisterDevicePointer(*client, "acts", buf, bytes));
//   auto ready = qtx::cuda::IpcEvent::Create();   // signalled by us
//   auto done = qtx::cuda::IpcEvent::Create();    // signalled by the sidecar
//   ... enqueue the producer on `stream`; cudaEventRecord(ready->get(), stream);
//   qtx::CallOptions call;
//   call.cuda_wait_event = ready->handle();
//   call.cuda_signal_event = done->handle();
//   client->Quantize(qtx::Tensor::InRegion(...), config, outputs, call);
//   cudaStreamWaitEvent(stream, done->get());     // outputs ready on `stream`
//
// Which memory works (RegisterDevicePointer and RegionCache pick the path):
// - cudaMalloc memory (PyTorch's default allocator): CUDA IPC.
// - VMM memory -- physical chunks from cuMemCreate mapped with cuMemMap
//   (PyTorch's expandable_segments:True, custom allocators): each chunk is
//   exported as a POSIX file descriptor (cuMemExportToShareableHandle) and
//   passed to qtxd over its fd socket (qtx/fd_passing.h); qtxd imports the
//   chunks and maps them contiguously. The chunks must have been created
//   with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes
//   and be mapped whole. qtxd then holds the physical memory itself: it
//   outlives a client that frees it or dies while qtxd's work still uses it.
//   Needs a unix-socket target.
// - cudaMallocAsync pools (PyTorch backend:cudaMallocAsync), managed
//   memory, host memory: INVALID_ARGUMENT naming the setting to change.
//
// Separate from the core client library, which never needs CUDA. Functions
// are thread-safe; an IpcEvent is one owner's, like a cudaEvent_t.
#ifndef QTX_CLIENT_CUDA_QTX_CUDA_IPC_H_
#define QTX_CLIENT_CUDA_QTX_CUDA_IPC_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "qtx/client.h"

namespace qtx::cuda {

// The 64-byte cudaIpcMemHandle_t of the allocation `device_ptr` came from.
// INVALID_ARGUMENT if it is not device memory from cudaMalloc (pool or
// managed memory cannot be exported this way), INTERNAL on other CUDA errors.
absl::StatusOr<std::string> ExportMemHandle(const void* device_ptr);

// Exports `device_ptr` and registers [device_ptr, device_ptr + byte_size)
// with the sidecar under `name`, with the device it lives on (by UUID).
// cudaMalloc memory goes by CUDA IPC; VMM memory by file descriptors of the
// chunks covering the range (see the top of this file).
// REQUIRES: for cudaMalloc memory, device_ptr is the start of the allocation
// (register the whole allocation and address parts of it with RegionSlice
// offsets); VMM memory may start anywhere in a mapped chunk.
// Errors as ExportMemHandle, ExportVmmRange and Client::RegisterCudaIpcRegion
// / RegisterCudaVmmRegion.
absl::Status RegisterDevicePointer(Client& client, std::string_view name, const void* device_ptr,
                                   uint64_t byte_size, const CallOptions& call = {});

// One physical chunk of VMM memory as the exporting process maps it.
struct VmmChunk {
  uintptr_t base = 0;  // its mapped address range [base, base + size)
  uint64_t size = 0;
  unsigned long long block_id = 0;  // the driver's id of the physical allocation
};

// The chunks of VMM memory that cover [ptr, ptr + bytes), in address order
// (cuMemGetAddressRange gives the mapped range of one chunk; the walk goes
// on at its end). Empty when `ptr` is not VMM memory (cudaMalloc memory, a
// pool, ...). INVALID_ARGUMENT when the range runs into an unmapped gap.
absl::StatusOr<std::vector<VmmChunk>> FindVmmChunks(const void* ptr, uint64_t bytes);

// Registers [first chunk base + offset, + byte_size) of `chunks` (from
// FindVmmChunks, contiguous) under `name`: checks each chunk (created with
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, mapped whole, all on one GPU),
// exports the descriptors, passes them over the fd socket of client's qtxd
// and registers the region. INVALID_ARGUMENT naming what to change for a
// chunk without the POSIX fd handle type or mapped in part;
// FAILED_PRECONDITION for a TCP target; the server's status otherwise.
absl::Status RegisterVmmChunks(Client& client, std::string_view name,
                               const std::vector<VmmChunk>& chunks, uint64_t offset,
                               uint64_t byte_size, const CallOptions& call = {});

// Device memory as the caching allocators of training frameworks hand it
// out: any pointer inside a cudaMalloc allocation (a PyTorch segment, say).
// Slice() finds the allocation (cuMemGetAddressRange), exports and registers
// it with qtxd once (by GPU UUID), and returns the region slice of the bytes
// asked for; later calls on the same allocation only look it up. An
// allocation freed and replaced by another at the same address is noticed
// (the driver's buffer id changes) and registered afresh, so a stale
// registration is never used. A repeated lookup of a registered cudaMalloc
// allocation costs one driver call (cuPointerGetAttributes: range start,
// range size, buffer id) and a map lookup.
//
// VMM memory (PyTorch's expandable_segments:True, cuMemCreate chunks with a
// POSIX fd handle type) is registered by descriptors: a region is the chunks
// covering the bytes asked for (a tensor may span several), cached under
// its first chunk and reused for any range it covers; a chunk unmapped and
// replaced is noticed (the driver's block id changes) and registered afresh.
// Memory that cannot be shared (cudaMallocAsync pools, chunks without the
// POSIX fd handle type, managed memory) fails with INVALID_ARGUMENT naming
// the allocator setting to change.
//
// One owner thread; unregisters everything it registered when destroyed.
class RegionCache {
 public:
  // `prefix` starts the region names ("<prefix>-<n>"); `client` must
  // outlive the cache.
  explicit RegionCache(Client& client, std::string prefix = "qtx-alloc");
  ~RegionCache();
  RegionCache(const RegionCache&) = delete;
  RegionCache& operator=(const RegionCache&) = delete;

  // The slice for [ptr, ptr + bytes). INVALID_ARGUMENT when ptr is not device
  // memory, the range leaves its allocation, or the allocation cannot be
  // exported; the server's status when registration fails.
  absl::StatusOr<RegionSlice> Slice(const void* ptr, uint64_t bytes);

  // Registrations made so far (for tests and metrics), and of them those of
  // VMM memory.
  uint64_t registrations() const { return registrations_; }
  uint64_t vmm_registrations() const { return vmm_registrations_; }
  // Slice() calls answered by the one-driver-call fast path (a cached CUDA
  // IPC registration whose allocation still has the same buffer id).
  uint64_t fast_hits() const { return fast_hits_; }
  // Benchmarks only: false makes every Slice() take the full path (three
  // driver calls), as before the fast path existed. Results are the same.
  void set_fast_path(bool on) { fast_path_ = on; }

 private:
  struct Entry {
    uint64_t size = 0;
    unsigned long long buffer_id = 0;
    std::string region;
  };
  Client& client_;
  const std::string prefix_;
  struct VmmEntry {
    std::vector<VmmChunk> chunks;  // contiguous, from the map key on
    std::string region;
  };
  absl::StatusOr<RegionSlice> VmmSlice(const void* ptr, uint64_t bytes,
                                       std::vector<VmmChunk> chunks);
  std::map<uintptr_t, Entry> by_base_;
  std::map<uintptr_t, std::vector<VmmEntry>> vmm_by_base_;
  uint64_t registrations_ = 0;
  uint64_t vmm_registrations_ = 0;
  uint64_t fast_hits_ = 0;
  bool fast_path_ = true;
  uint64_t next_name_ = 0;
};

// An interprocess event (cudaEventInterprocess | cudaEventDisableTiming) on
// the current device, and its 64-byte handle for CallOptions. Movable.
class IpcEvent {
 public:
  // INTERNAL on a CUDA error.
  static absl::StatusOr<IpcEvent> Create();
  IpcEvent(IpcEvent&& other) noexcept;
  IpcEvent& operator=(IpcEvent&& other) noexcept;
  IpcEvent(const IpcEvent&) = delete;
  IpcEvent& operator=(const IpcEvent&) = delete;
  ~IpcEvent();

  cudaEvent_t get() const { return event_; }
  // The cudaIpcEventHandle_t bytes (64).
  const std::string& handle() const { return handle_; }

 private:
  IpcEvent(cudaEvent_t event, std::string handle) : event_(event), handle_(std::move(handle)) {}
  cudaEvent_t event_ = nullptr;
  std::string handle_;
};

}  // namespace qtx::cuda

#endif  // QTX_CLIENT_CUDA_QTX_CUDA_IPC_H_

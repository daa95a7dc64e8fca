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
// Separate from the core client library, which never needs CUDA. Functions
// are thread-safe; an IpcEvent is one owner's, like a cudaEvent_t.
#ifndef QTX_CLIENT_CUDA_QTX_CUDA_IPC_H_
#define QTX_CLIENT_CUDA_QTX_CUDA_IPC_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "qtx/client.h"

namespace qtx::cuda {

// The 64-byte cudaIpcMemHandle_t of the allocation `device_ptr` came from.
// INVALID_ARGUMENT if it is not device memory from cudaMalloc (pool or
// managed memory cannot be exported this way), INTERNAL on other CUDA errors.
absl::StatusOr<std::string> ExportMemHandle(const void* device_ptr);

// Exports `device_ptr` and registers [device_ptr, device_ptr + byte_size)
// with the sidecar under `name`, with the device it lives on.
// REQUIRES: device_ptr is the start of a cudaMalloc allocation (register
// the whole allocation and address parts of it with RegionSlice offsets).
// Errors as ExportMemHandle and Client::RegisterCudaIpcRegion.
absl::Status RegisterDevicePointer(Client& client, std::string_view name, const void* device_ptr,
                                   uint64_t byte_size, const CallOptions& call = {});

// Device memory as the caching allocators of training frameworks hand it
// out: any pointer inside a cudaMalloc allocation (a PyTorch segment, say).
// Slice() finds the allocation (cuMemGetAddressRange), exports and registers
// it with qtxd once (by GPU UUID), and returns the region slice of the bytes
// asked for; later calls on the same allocation only look it up. An
// allocation freed and replaced by another at the same address is noticed
// (the driver's buffer id changes) and registered afresh, so a stale
// registration is never used.
//
// Memory that CUDA IPC cannot export (cudaMallocAsync pools, VMM /
// cuMemCreate, PyTorch with expandable_segments:True) fails with
// INVALID_ARGUMENT naming the allocator setting to change.
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

  // Registrations made so far (for tests and metrics).
  uint64_t registrations() const { return registrations_; }

 private:
  struct Entry {
    uint64_t size = 0;
    unsigned long long buffer_id = 0;
    std::string region;
  };
  Client& client_;
  const std::string prefix_;
  std::map<uintptr_t, Entry> by_base_;
  uint64_t registrations_ = 0;
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

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

#include "qtx/cuda_ipc.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace qtx::cuda {
namespace {

absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  (void)cudaGetLastError();  // clear the non-sticky error
  return absl::InternalError(
      absl::StrFormat("%s: CUDA error %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err)));
}

}  // namespace

absl::StatusOr<std::string> ExportMemHandle(const void* device_ptr) {
  cudaPointerAttributes attr = {};
  cudaError_t err = cudaPointerGetAttributes(&attr, device_ptr);
  if (err != cudaSuccess) return CudaStatus(err, "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pointer %p is not device memory (cudaMemoryType %d): only cudaMalloc memory can be "
        "exported",
        device_ptr, static_cast<int>(attr.type)));
  }
  cudaIpcMemHandle_t handle;
  err = cudaIpcGetMemHandle(&handle, const_cast<void*>(device_ptr));
  if (err == cudaErrorInvalidValue) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrFormat(
        "cudaIpcGetMemHandle(%p) failed: export memory from cudaMalloc (not cudaMallocAsync "
        "pools, VMM/cuMemCreate allocations or managed memory; in PyTorch set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False and keep the default allocator "
        "backend)",
        device_ptr));
  }
  if (err != cudaSuccess) return CudaStatus(err, "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

absl::Status RegisterDevicePointer(Client& client, std::string_view name, const void* device_ptr,
                                   uint64_t byte_size, const CallOptions& call) {
  cudaPointerAttributes attr = {};
  const cudaError_t err = cudaPointerGetAttributes(&attr, device_ptr);
  if (err != cudaSuccess) return CudaStatus(err, "cudaPointerGetAttributes");
  auto handle = ExportMemHandle(device_ptr);
  if (!handle.ok()) return handle.status();
  return client.RegisterCudaIpcRegion(name, *handle, attr.device, byte_size, call);
}

absl::StatusOr<IpcEvent> IpcEvent::Create() {
  cudaEvent_t event = nullptr;
  cudaError_t err =
      cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming);
  if (err != cudaSuccess) return CudaStatus(err, "cudaEventCreateWithFlags(interprocess)");
  cudaIpcEventHandle_t handle;
  err = cudaIpcGetEventHandle(&handle, event);
  if (err != cudaSuccess) {
    absl::Status s = CudaStatus(err, "cudaIpcGetEventHandle");
    (void)cudaEventDestroy(event);
    return s;
  }
  return IpcEvent(event, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
}

IpcEvent::IpcEvent(IpcEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)), handle_(std::move(other.handle_)) {}

IpcEvent& IpcEvent::operator=(IpcEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
    handle_ = std::move(other.handle_);
  }
  return *this;
}

IpcEvent::~IpcEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

}  // namespace qtx::cuda

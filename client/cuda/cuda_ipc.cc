#include "qtx/cuda_ipc.h"

#include <cuda.h>

#include <utility>

#include "absl/strings/str_format.h"
#include "driver_symbols.h"

namespace qtx::cuda {
namespace internal {

absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  (void)cudaGetLastError();  // clear the non-sticky error
  return absl::InternalError(
      absl::StrFormat("%s: CUDA error %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err)));
}

absl::Status LoadDriverSymbols(std::span<const std::pair<const char*, void**>> wanted) {
  for (const auto& [symbol, slot] : wanted) {
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion(symbol, slot, 12000, cudaEnableDefault, &query);
    if (err != cudaSuccess) return CudaStatus(err, "cudaGetDriverEntryPointByVersion");
    if (query != cudaDriverEntryPointSuccess || *slot == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrFormat("the CUDA driver has no %s (a CUDA 12+ driver is needed)", symbol));
    }
  }
  return absl::OkStatus();
}

}  // namespace internal

using internal::CudaStatus;

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
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrFormat(
        "cudaIpcGetMemHandle(%p) failed (%s): export memory from cudaMalloc (not cudaMallocAsync "
        "pools, VMM/cuMemCreate allocations or managed memory; in PyTorch set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False and keep the default allocator "
        "backend)",
        device_ptr, cudaGetErrorName(err)));
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

absl::Status RegisterDevicePointer(Client& client, std::string_view name, const void* device_ptr,
                                   uint64_t byte_size, const CallOptions& call) {
  cudaPointerAttributes attr = {};
  const cudaError_t err = cudaPointerGetAttributes(&attr, device_ptr);
  if (err != cudaSuccess) return CudaStatus(err, "cudaPointerGetAttributes");
  auto handle = ExportMemHandle(device_ptr);
  if (!handle.ok()) return handle.status();
  // The GPU by UUID: ordinals differ between processes whose
  // CUDA_VISIBLE_DEVICES differ.
  cudaDeviceProp prop;
  const cudaError_t perr = cudaGetDeviceProperties(&prop, attr.device);
  if (perr != cudaSuccess) return CudaStatus(perr, "cudaGetDeviceProperties");
  return client.RegisterCudaIpcRegionOnGpu(
      name, *handle, std::string_view(reinterpret_cast<const char*>(prop.uuid.bytes), 16),
      byte_size, call);
}

namespace {

// Driver calls the allocation lookup needs, found through the runtime (no
// link against libcuda).
struct AllocationOps {
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*pointer_attribute)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
};

absl::StatusOr<AllocationOps> GetAllocationOps() {
  static const auto* const ops =
      new absl::StatusOr<AllocationOps>([]() -> absl::StatusOr<AllocationOps> {
        AllocationOps o;
        const std::pair<const char*, void**> wanted[] = {
            {"cuMemGetAddressRange", reinterpret_cast<void**>(&o.address_range)},
            {"cuPointerGetAttribute", reinterpret_cast<void**>(&o.pointer_attribute)}};
        if (absl::Status s = internal::LoadDriverSymbols(wanted); !s.ok()) return s;
        return o;
      }());
  return *ops;
}

}  // namespace

RegionCache::RegionCache(Client& client, std::string prefix)
    : client_(client), prefix_(std::move(prefix)) {}

RegionCache::~RegionCache() {
  for (const auto& [base, e] : by_base_) (void)client_.UnregisterRegion(e.region);
}

absl::StatusOr<RegionSlice> RegionCache::Slice(const void* ptr, uint64_t bytes) {
  absl::StatusOr<AllocationOps> ops = GetAllocationOps();
  if (!ops.ok()) return ops.status();
  const auto p = reinterpret_cast<CUdeviceptr>(ptr);
  CUdeviceptr base = 0;
  size_t size = 0;
  if (ops->address_range(&base, &size, p) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pointer %p is not in a device allocation of this process (cuMemGetAddressRange)", ptr));
  }
  if (bytes > size || p - base > size - bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "[%p, +%d) leaves its allocation [0x%x, +%d)", ptr, bytes, base, size));
  }
  unsigned long long buffer_id = 0;
  if (ops->pointer_attribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pointer %p: the driver has no buffer id for it", ptr));
  }
  auto it = by_base_.find(base);
  if (it != by_base_.end() && (it->second.buffer_id != buffer_id || it->second.size != size)) {
    // Freed and replaced at the same address: the old registration is stale.
    (void)client_.UnregisterRegion(it->second.region);
    by_base_.erase(it);
    it = by_base_.end();
  }
  if (it == by_base_.end()) {
    Entry e{size, buffer_id, absl::StrFormat("%s-%d", prefix_, next_name_++)};
    absl::Status s =
        RegisterDevicePointer(client_, e.region, reinterpret_cast<const void*>(base), size);
    if (!s.ok()) return s;
    ++registrations_;
    it = by_base_.emplace(base, std::move(e)).first;
  }
  return RegionSlice{it->second.region, p - base, bytes};
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

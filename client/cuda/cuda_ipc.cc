#include "qtx/cuda_ipc.h"

#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/cuda_driver.h"
#include "cuda_status.h"
#include "qtx/fd_passing.h"

namespace qtx::cuda {
namespace internal {

absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  (void)cudaGetLastError();  // clear the non-sticky error
  return absl::InternalError(absl::StrFormat("%s: CUDA error %s (%s)", what, cudaGetErrorName(err),
                                             cudaGetErrorString(err)));
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
        "cudaIpcGetMemHandle(%p) failed (%s): CUDA IPC exports cudaMalloc memory only (not "
        "cudaMallocAsync pools, VMM/cuMemCreate allocations or managed memory); "
        "RegisterDevicePointer and RegionCache pass VMM memory made with "
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR by file descriptors instead; in PyTorch keep "
        "the default allocator backend (backend:native), with expandable_segments True or False",
        device_ptr, cudaGetErrorName(err)));
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

namespace {

using cuda_driver::MemoryOps;

// What the driver says about the memory at `p`, in one call.
struct PointerFacts {
  bool valid = false;        // a CUDA pointer at all
  bool ipc_capable = false;  // cudaIpcGetMemHandle works (cudaMalloc memory)
  bool pooled = false;       // from a cudaMallocAsync pool
  bool mapped = false;
  unsigned long long block_id = 0;
  unsigned long long buffer_id = 0;
  int device = -1;
};

PointerFacts QueryPointer(const MemoryOps& ops, CUdeviceptr p) {
  int memory_type = 0, ipc = 0, mapped = 0, device = -1;
  void* pool = nullptr;
  unsigned long long block = 0, buffer = 0;
  CUpointer_attribute attrs[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE,    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
      CU_POINTER_ATTRIBUTE_MAPPED,         CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID,
      CU_POINTER_ATTRIBUTE_BUFFER_ID};
  void* data[] = {&memory_type, &ipc, &mapped, &device, &pool, &block, &buffer};
  PointerFacts f;
  if (ops.pointer_attributes(7, attrs, data, p) != CUDA_SUCCESS) return f;
  f.valid = memory_type != 0;
  f.ipc_capable = ipc != 0;
  f.pooled = pool != nullptr;
  f.mapped = mapped != 0;
  f.block_id = block;
  f.buffer_id = buffer;
  f.device = device;
  return f;
}

enum class MemoryPath { kCudaIpc, kVmm, kPool, kNone };

// How memory at `p` can reach qtxd.
MemoryPath Classify(const MemoryOps& ops, CUdeviceptr p) {
  const PointerFacts f = QueryPointer(ops, p);
  if (f.ipc_capable) return MemoryPath::kCudaIpc;
  CUmemGenericAllocationHandle h = 0;
  if (ops.retain(&h, reinterpret_cast<void*>(p)) == CUDA_SUCCESS) {
    (void)ops.release(h);
    return f.pooled ? MemoryPath::kPool : MemoryPath::kVmm;
  }
  (void)cudaGetLastError();
  return f.pooled ? MemoryPath::kPool : MemoryPath::kNone;
}

absl::Status PoolError(const void* ptr) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "pointer %p is in a cudaMallocAsync memory pool, which qtx cannot register (neither CUDA "
      "IPC nor whole-chunk file descriptors reach pool sub-allocations): in PyTorch use the "
      "native allocator (PYTORCH_CUDA_ALLOC_CONF=backend:native, the default; "
      "expandable_segments:True works with it), otherwise allocate the buffers qtx reads and "
      "writes with cudaMalloc or with cuMemCreate using "
      "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
      ptr));
}

// Closes the descriptors on scope exit.
struct FdList {
  std::vector<int> fds;
  ~FdList() {
    for (int fd : fds) ::close(fd);
  }
};

absl::StatusOr<std::string> DeviceUuid(int device) {
  cudaDeviceProp prop;
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return CudaStatus(err, "cudaGetDeviceProperties");
  return std::string(reinterpret_cast<const char*>(prop.uuid.bytes), 16);
}

}  // namespace

absl::StatusOr<std::vector<VmmChunk>> FindVmmChunks(const void* ptr, uint64_t bytes) {
  absl::StatusOr<MemoryOps> ops = cuda_driver::GetMemoryOps();
  if (!ops.ok()) return ops.status();
  const auto p = reinterpret_cast<CUdeviceptr>(ptr);
  if (Classify(*ops, p) != MemoryPath::kVmm) return std::vector<VmmChunk>{};
  std::vector<VmmChunk> chunks;
  const uint64_t end = bytes > UINT64_MAX - p ? UINT64_MAX : p + bytes;
  CUdeviceptr at = p;
  do {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (ops->address_range(&base, &size, at) != CUDA_SUCCESS || size == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "[%p, +%d) runs into unmapped address space at 0x%x (VMM memory; the range must lie "
          "in mapped chunks)",
          ptr, bytes, at));
    }
    const PointerFacts f = QueryPointer(*ops, base);
    unsigned long long id = f.block_id != 0 ? f.block_id : f.buffer_id;
    if (id == 0 &&
        ops->pointer_attribute(&id, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID, base) != CUDA_SUCCESS &&
        ops->pointer_attribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base) != CUDA_SUCCESS) {
      id = 0;
      (void)cudaGetLastError();
    }
    chunks.push_back(VmmChunk{static_cast<uintptr_t>(base), size, id});
    at = base + size;
  } while (at < end);
  return chunks;
}

absl::Status RegisterVmmChunks(Client& client, std::string_view name,
                               const std::vector<VmmChunk>& chunks, uint64_t offset,
                               uint64_t byte_size, const CallOptions& call) {
  absl::StatusOr<MemoryOps> ops = cuda_driver::GetMemoryOps();
  if (!ops.ok()) return ops.status();
  if (chunks.empty()) return absl::InvalidArgumentError("no VMM chunks to register");
  FdList exported;
  std::vector<uint64_t> sizes;
  int device = -1;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const VmmChunk& c = chunks[i];
    if (i > 0 && chunks[i - 1].base + chunks[i - 1].size != c.base) {
      return absl::InvalidArgumentError("VMM chunks are not contiguous");
    }
    CUmemGenericAllocationHandle h = 0;
    if (ops->retain(&h, reinterpret_cast<void*>(c.base)) != CUDA_SUCCESS) {
      (void)cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrFormat(
          "0x%x: not VMM memory (the range leaves the cuMemMap-ed chunks into other memory, or "
          "the chunk was unmapped meanwhile); register VMM and other memory apart",
          c.base));
    }
    struct Releaser {
      const MemoryOps& ops;
      CUmemGenericAllocationHandle h;
      ~Releaser() { (void)ops.release(h); }
    } releaser{*ops, h};
    CUmemAllocationProp prop = {};
    if (const CUresult r = ops->properties(&prop, h); r != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrFormat(
          "cuMemGetAllocationPropertiesFromHandle: CUresult %d", static_cast<int>(r)));
    }
    if ((prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
      const bool fabric = (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) != 0;
      return absl::InvalidArgumentError(absl::StrFormat(
          "VMM chunk [0x%x, +%d) was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in "
          "requestedHandleTypes (it has 0x%x%s), so it cannot be passed to qtxd: create "
          "cuMemCreate chunks with that handle type, or in PyTorch set "
          "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (cudaMalloc segments, shared by "
          "CUDA IPC)",
          c.base, c.size, static_cast<unsigned>(prop.requestedHandleTypes),
          fabric ? ": fabric handles, which qtx does not import" : ""));
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      return absl::InvalidArgumentError(
          absl::StrFormat("VMM chunk [0x%x, +%d) is not device memory (location type %d)", c.base,
                          c.size, static_cast<int>(prop.location.type)));
    }
    if (device < 0) device = prop.location.id;
    if (prop.location.id != device) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the range spans VMM chunks on cuda:%d and cuda:%d: register each GPU's part apart",
          device, prop.location.id));
    }
    // qtxd maps each chunk from the start of its allocation: the chunk must
    // be the whole allocation. A mapping of size + granularity from offset 0
    // succeeds only if the allocation is larger than the mapped range.
    size_t gran = 0;
    if (ops->granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
        gran == 0) {
      return absl::InternalError("cuMemGetAllocationGranularity failed");
    }
    CUdeviceptr probe = 0;
    const size_t probe_size = c.size + gran;
    if (ops->reserve(&probe, probe_size, gran, 0, 0) != CUDA_SUCCESS) {
      return absl::ResourceExhaustedError("cannot reserve address space to check a VMM chunk");
    }
    const bool larger = ops->map(probe, probe_size, 0, h, 0) == CUDA_SUCCESS;
    if (larger) (void)ops->unmap(probe, probe_size);
    (void)ops->free_range(probe, probe_size);
    (void)cudaGetLastError();
    if (larger) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "VMM chunk [0x%x, +%d) maps only part of its cuMemCreate allocation: qtx passes whole "
          "allocations, so map each allocation whole with one cuMemMap (as PyTorch's expandable "
          "segments do)",
          c.base, c.size));
    }
    int fd = -1;
    if (const CUresult r = ops->export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        r != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrFormat(
          "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) of chunk 0x%x: CUresult %d", c.base,
          static_cast<int>(r)));
    }
    exported.fds.push_back(fd);
    sizes.push_back(c.size);
  }
  absl::StatusOr<std::string> uuid = DeviceUuid(device);
  if (!uuid.ok()) return uuid.status();
  absl::StatusOr<std::shared_ptr<FdPassingConnection>> conn =
      SharedFdPassingConnection(client.target());
  if (!conn.ok()) return conn.status();
  std::vector<std::string> tokens;
  for (size_t i = 0; i < exported.fds.size(); i += kMaxFdsPerBatch) {
    const size_t n = std::min<size_t>(kMaxFdsPerBatch, exported.fds.size() - i);
    absl::StatusOr<std::string> token =
        (*conn)->Send(std::span<const int>(exported.fds.data() + i, n));
    if (!token.ok()) return token.status();
    tokens.push_back(*std::move(token));
  }
  return client.RegisterCudaVmmRegion(name, tokens, sizes, offset, byte_size, *uuid, call);
}

absl::Status RegisterDevicePointer(Client& client, std::string_view name, const void* device_ptr,
                                   uint64_t byte_size, const CallOptions& call) {
  absl::StatusOr<MemoryOps> ops = cuda_driver::GetMemoryOps();
  if (!ops.ok()) return ops.status();
  if (Classify(*ops, reinterpret_cast<CUdeviceptr>(device_ptr)) == MemoryPath::kPool) {
    return PoolError(device_ptr);
  }
  absl::StatusOr<std::vector<VmmChunk>> chunks = FindVmmChunks(device_ptr, byte_size);
  if (!chunks.ok()) return chunks.status();
  if (!chunks->empty()) {
    const uint64_t offset = reinterpret_cast<uintptr_t>(device_ptr) - chunks->front().base;
    return RegisterVmmChunks(client, name, *chunks, offset, byte_size, call);
  }
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

RegionCache::RegionCache(Client& client, std::string prefix)
    : client_(client), prefix_(std::move(prefix)) {}

RegionCache::~RegionCache() {
  for (const auto& [base, e] : by_base_) (void)client_.UnregisterRegion(e.region);
  for (const auto& [base, entries] : vmm_by_base_) {
    for (const VmmEntry& e : entries) (void)client_.UnregisterRegion(e.region);
  }
}

absl::StatusOr<RegionSlice> RegionCache::Slice(const void* ptr, uint64_t bytes) {
  absl::StatusOr<MemoryOps> ops = cuda_driver::GetMemoryOps();
  if (!ops.ok()) return ops.status();
  const auto p = reinterpret_cast<CUdeviceptr>(ptr);
  if (fast_path_) {
    // Fast path, one driver call: the allocation's range and buffer id. A
    // cached CUDA IPC registration of that very allocation (same base, size
    // and process-unique buffer id) is used as is; anything else (a miss, VMM
    // memory, an allocation freed and replaced at the same address, which
    // has a new id) takes the full path below.
    CUdeviceptr fbase = 0;
    size_t fsize = 0;
    unsigned long long fid = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                   CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID};
    void* data[] = {&fbase, &fsize, &fid};
    if (ops->pointer_attributes(3, attrs, data, p) == CUDA_SUCCESS && fbase != 0 && fid != 0) {
      auto hit = by_base_.find(fbase);
      if (hit != by_base_.end() && hit->second.buffer_id == fid && hit->second.size == fsize &&
          bytes <= fsize && p - fbase <= fsize - bytes) {
        ++fast_hits_;
        return RegionSlice{hit->second.region, p - fbase, bytes};
      }
    }
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (ops->address_range(&base, &size, p) != CUDA_SUCCESS) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrFormat(
        "pointer %p is not in a device allocation of this process (cuMemGetAddressRange)", ptr));
  }
  switch (Classify(*ops, p)) {
    case MemoryPath::kCudaIpc:
      break;
    case MemoryPath::kVmm: {
      absl::StatusOr<std::vector<VmmChunk>> chunks = FindVmmChunks(ptr, bytes);
      if (!chunks.ok()) return chunks.status();
      if (chunks->empty()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("pointer %p: VMM memory that vanished while looked at", ptr));
      }
      return VmmSlice(ptr, bytes, *std::move(chunks));
    }
    case MemoryPath::kPool:
      return PoolError(ptr);
    case MemoryPath::kNone:
      break;  // ExportMemHandle below says why
  }
  if (bytes > size || p - base > size - bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("[%p, +%d) leaves its allocation [0x%x, +%d)", ptr, bytes, base, size));
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

absl::StatusOr<RegionSlice> RegionCache::VmmSlice(const void* ptr, uint64_t bytes,
                                                  std::vector<VmmChunk> chunks) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t first = chunks.front().base;
  std::vector<VmmEntry>& entries = vmm_by_base_[first];
  auto same = [](const VmmChunk& a, const VmmChunk& b) {
    return a.base == b.base && a.size == b.size && a.block_id == b.block_id;
  };
  for (auto e = entries.begin(); e != entries.end();) {
    const size_t overlap = std::min(e->chunks.size(), chunks.size());
    bool stale = false;
    for (size_t i = 0; i < overlap; ++i) stale = stale || !same(e->chunks[i], chunks[i]);
    if (stale) {
      // A chunk was unmapped and replaced: the registration shows old memory.
      (void)client_.UnregisterRegion(e->region);
      e = entries.erase(e);
      continue;
    }
    if (e->chunks.size() >= chunks.size()) return RegionSlice{e->region, p - first, bytes};
    ++e;
  }
  uint64_t total = 0;
  for (const VmmChunk& c : chunks) total += c.size;
  VmmEntry entry{chunks, absl::StrFormat("%s-%d", prefix_, next_name_++)};
  absl::Status s = RegisterVmmChunks(client_, entry.region, chunks, 0, total);
  if (!s.ok()) return s;
  ++registrations_;
  ++vmm_registrations_;
  entries.push_back(std::move(entry));
  return RegionSlice{entries.back().region, p - first, bytes};
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

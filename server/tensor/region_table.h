// RegionTable: the named memory regions a client registered with the Memory
// service (POSIX shared memory now; CUDA IPC through a hook that the CUDA
// device supplies), and the pins that keep a region mapped while a request
// uses it.
//
// Ownership: the table holds one reference to each registered Region. A
// request that resolves a region gets a pin (a shared_ptr) that keeps the
// mapping alive until the request drops it, even if the region is
// unregistered meanwhile; the mapping is released by the last holder.
//
// Thread safety: all methods are safe for concurrent use. Pins may be dropped
// on any thread.
#ifndef QTX_SERVER_TENSOR_REGION_TABLE_H_
#define QTX_SERVER_TENSOR_REGION_TABLE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/tensor/mapped_memory.h"

namespace qtx::server::tensor {

enum class RegionKind { kShm, kCudaIpc, kCudaVmm };

// One registered region. Immutable after registration except for the pin
// count; safe for concurrent use.
class Region {
 public:
  Region(std::string name, RegionKind kind, std::string shm_name, int32_t device_id,
         uint64_t byte_size, MappedMemory memory, uint64_t session = 0);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const std::string& name() const { return name_; }
  RegionKind kind() const { return kind_; }
  MemoryKind memory_kind() const {
    return kind_ == RegionKind::kShm ? MemoryKind::kHost : MemoryKind::kDevice;
  }
  const std::string& shm_name() const { return shm_name_; }  // shm regions only
  int32_t device_id() const { return device_id_; }           // CUDA regions only
  // The fd-socket session whose descriptors made the region (cuda_vmm), or 0.
  uint64_t session() const { return session_; }
  uint64_t byte_size() const { return byte_size_; }
  // First byte of the registered range [0, byte_size()).
  std::byte* data() const { return memory_.data; }
  // Number of live pins (requests currently using the region).
  uint32_t in_use() const { return pins_.load(std::memory_order_relaxed); }
  // OK while every byte still is the client's memory. DATA_LOSS once the
  // region lost pages under a request (its shm object was truncated): what
  // was read from it or written to it since is not the client's data. Ops
  // check their regions with this when they end (ops::RegionsIntact).
  absl::Status Intact() const;

 private:
  friend class RegionTable;

  // Constant after construction.
  const std::string name_;
  const RegionKind kind_;
  const std::string shm_name_;
  const int32_t device_id_;
  const uint64_t byte_size_;
  const MappedMemory memory_;
  const uint64_t session_;

  std::atomic<uint32_t> pins_{0};
};

// OK for a null pin (inline data) or an intact region; Region::Intact's
// DATA_LOSS otherwise. Ops call it on every pin once their work is done.
absl::Status CheckIntact(const std::shared_ptr<const Region>& pin);

// A snapshot of one region for listing.
struct RegionInfo {
  std::string name;
  RegionKind kind = RegionKind::kShm;
  uint64_t byte_size = 0;
  std::string shm_name;
  int32_t device_id = 0;
  uint32_t in_use = 0;
};

struct RegionTableOptions {
  // Client-provided POSIX shm is opt-in (qtxd --allow_client_shm).
  bool allow_client_shm = false;
  // Null in a CPU-only server: CUDA IPC registration fails with
  // FAILED_PRECONDITION after its arguments are validated.
  CudaIpcOpener cuda_ipc_opener;
  // Null in a CPU-only server: cuda_vmm registration fails with
  // FAILED_PRECONDITION (cuda_ipc_unavailable_reason) after validation.
  CudaVmmOpener cuda_vmm_opener;
  CudaUuidResolver cuda_uuid_resolver;
  // Human-readable reason shown when cuda_ipc_opener is null.
  std::string cuda_ipc_unavailable_reason = "cuda_ipc regions need qtxd --device=cuda:N";
  // Registering more regions than this fails with RESOURCE_EXHAUSTED.
  size_t max_regions = 4096;
};

// Length of a cudaIpcMemHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;
inline constexpr size_t kMaxRegionNameLength = 128;

class RegionTable {
 public:
  explicit RegionTable(RegionTableOptions options);
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  // Opens the POSIX shm object `shm_name` read-write and maps its bytes
  // [offset, offset + byte_size) under `name`.
  // FAILED_PRECONDITION if shm is not allowed (--allow_client_shm);
  // INVALID_ARGUMENT for a bad name or shm_name, byte_size == 0, or a range
  // beyond the object's real size; ALREADY_EXISTS if `name` is taken;
  // NOT_FOUND if the shm object does not exist; PERMISSION_DENIED if it
  // cannot be opened read-write; RESOURCE_EXHAUSTED past max_regions.
  absl::Status RegisterShm(std::string_view name, std::string_view shm_name, uint64_t offset,
                           uint64_t byte_size);

  // Registers device memory exported with cudaIpcGetMemHandle.
  // INVALID_ARGUMENT for a bad name, a handle that is not exactly 64 bytes,
  // device_id < 0 or byte_size == 0; FAILED_PRECONDITION when this server has
  // no CUDA IPC opener; otherwise as RegisterShm and as the opener returns.
  // `device_uuid` (16 bytes), when not empty, names the GPU instead of
  // device_id (resolved to this process's ordinal): INVALID_ARGUMENT for a
  // wrong length, NOT_FOUND for a GPU this server does not see.
  absl::Status RegisterCudaIpc(std::string_view name, std::string_view ipc_handle,
                               int32_t device_id, uint64_t byte_size,
                               std::string_view device_uuid = {});

  // Registers device memory made of cuMemCreate chunks whose POSIX fd
  // handles are `fds` (one per chunk, borrowed: the caller closes them once
  // this returns; the imported memory does not need them). `session` (the
  // fd-socket connection they came on) is recorded for UnregisterSession.
  // INVALID_ARGUMENT for a bad name, no chunks, a chunk count other than the
  // descriptor count, a zero chunk size, byte_size == 0, offset + byte_size
  // beyond the chunks, a device_uuid that is not 16 bytes;
  // FAILED_PRECONDITION when this server has no VMM opener; NOT_FOUND for a
  // GPU this server does not see; otherwise as RegisterShm and as the opener
  // returns.
  absl::Status RegisterCudaVmm(std::string_view name, std::span<const int> fds,
                               std::span<const uint64_t> chunk_sizes, uint64_t offset,
                               uint64_t byte_size, std::string_view device_uuid, uint64_t session);

  // Removes `name` at once; requests that hold a pin keep the mapping until
  // they drop it. NOT_FOUND if `name` is not registered.
  absl::Status Unregister(std::string_view name);

  // Removes every region registered with descriptors of fd-socket session
  // `session` (its client disconnected or died), as Unregister does. Returns
  // how many were removed.
  size_t UnregisterSession(uint64_t session);

  // Pins region `name`: the returned pointer keeps it mapped and counts in
  // in_use() until every copy is dropped. NOT_FOUND if not registered;
  // FAILED_PRECONDITION if its shm object has shrunk below the registered
  // range since registration (touching it would fault).
  absl::StatusOr<std::shared_ptr<const Region>> Acquire(std::string_view name) const;

  // All registered regions, sorted by name.
  std::vector<RegionInfo> List() const;

  size_t size() const;

 private:
  // OK if `name` is free and there is room; REQUIRES nothing (takes mu_).
  absl::Status CheckNameFree(std::string_view name) const;
  absl::Status Insert(std::shared_ptr<Region> region);

  // Constant after construction.
  const RegionTableOptions options_;

  // State below is protected by mu_.
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Region>, std::less<>> regions_ ABSL_GUARDED_BY(mu_);
};

// OK if `name` is 1..128 chars of [A-Za-z0-9_.:/-]; else INVALID_ARGUMENT
// naming `field`.
absl::Status ValidateRegionName(std::string_view name, std::string_view field);

// OK if `shm_name` is a portable POSIX shm name: "/" followed by 1..254 chars,
// none of them '/' or NUL; else INVALID_ARGUMENT naming `field`.
absl::Status ValidateShmName(std::string_view shm_name, std::string_view field);

}  // namespace qtx::server::tensor

#endif  // QTX_SERVER_TENSOR_REGION_TABLE_H_

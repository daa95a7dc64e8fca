// qtx::ShmRegion: a POSIX shared-memory object created by this process,
// mapped read/write, to be registered with qtxd (Client::RegisterShmRegion) so
// that tensors travel as (region, offset, size) instead of bytes in messages.
//
// The region owns the shm object: the destructor unmaps it and shm_unlink()s
// the name (a server that still has it mapped keeps its mapping). Unregister
// it from the server before destroying it.
//
// Tensors are placed with a bump allocator (Allocate, Place, AllocateTensor,
// AllocateQuantizeOutputs); Reset() starts over. The allocator is for one
// caller at a time; the mapped bytes may be read and written from any thread,
// subject to the usual data-race rules against the server writing outputs.
#ifndef QTX_CLIENT_QTX_SHM_REGION_H_
#define QTX_CLIENT_QTX_SHM_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "qtx/types.h"

namespace qtx {

class ShmRegion {
 public:
  // Creates a new shm object of `byte_size` bytes (zero-filled) and maps it.
  // `name` is the region name used with the server (1..128 characters of
  // [A-Za-z0-9_.:/-]). `shm_name` is the shm_open name ("/something", no
  // other '/'); empty picks a fresh "/qtx-<pid>-<random>" name.
  // Fails with INVALID_ARGUMENT for bad names or byte_size == 0,
  // ALREADY_EXISTS when `shm_name` exists (O_EXCL), and INTERNAL / the errno's
  // code for shm_open, ftruncate or mmap failures.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(std::string_view name,
                                                           uint64_t byte_size,
                                                           std::string_view shm_name = "");

  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();

  const std::string& name() const { return name_; }
  const std::string& shm_name() const { return shm_name_; }
  uint64_t size() const { return size_; }
  std::byte* data() const { return base_; }
  std::span<std::byte> bytes() const { return {base_, static_cast<size_t>(size_)}; }

  // Bytes handed out so far (the bump allocator's offset).
  uint64_t used() const { return used_; }
  // Forgets all allocations (does not clear the bytes).
  void Reset() { used_ = 0; }

  // Reserves `byte_size` bytes aligned to `alignment` (a power of two).
  // Fails with RESOURCE_EXHAUSTED when the region has no room left and
  // INVALID_ARGUMENT for a bad alignment.
  absl::StatusOr<RegionSlice> Allocate(uint64_t byte_size, uint64_t alignment = 64);

  // Copies the inline tensor `tensor` into a new allocation and returns the
  // region tensor describing it. Fails with INVALID_ARGUMENT when `tensor` is
  // already a region tensor or its byte count disagrees with dtype and shape,
  // and like Allocate.
  absl::StatusOr<Tensor> Place(const Tensor& tensor, uint64_t alignment = 64);

  // Reserves room for a tensor of `dtype` and `shape` (e.g. an output).
  absl::StatusOr<Tensor> AllocateTensor(DType dtype, std::vector<int64_t> shape,
                                        uint64_t alignment = 64);

  // Reserves one slice per buffer that quantizing a tensor of `shape` with
  // `config` produces (per ComputeQuantizedLayout), for Client::Quantize.
  absl::StatusOr<QuantizeOutputs> AllocateQuantizeOutputs(std::span<const int64_t> shape,
                                                          const QuantizeConfig& config,
                                                          uint64_t alignment = 64);

  // The bytes of `slice`, which must name this region and lie inside it.
  // Fails with INVALID_ARGUMENT otherwise.
  absl::StatusOr<std::span<std::byte>> View(const RegionSlice& slice) const;

  // Returns `tensor` with its bytes inline: a region tensor of this region is
  // copied out; an inline tensor is returned as is. Fails like View.
  absl::StatusOr<Tensor> ToInline(const Tensor& tensor) const;

 private:
  ShmRegion(std::string name, std::string shm_name, uint64_t size, int fd, std::byte* base);

  // Constant after construction.
  const std::string name_;
  const std::string shm_name_;
  const uint64_t size_;
  const int fd_;
  std::byte* const base_;

  // Used by one caller at a time.
  uint64_t used_ = 0;
};

}  // namespace qtx

#endif  // QTX_CLIENT_QTX_SHM_REGION_H_

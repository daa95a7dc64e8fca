// Plain descriptions of tensors as a request names them (TensorRefSpec:
// inline bytes or a region slice), and the resolved views the ops work on
// (TensorView for inputs, OutputSlice for client-provided outputs).
//
// Resolution validates everything a client controls before any work: dtype,
// rank, dims, overflow-safe element and byte counts, byte-count agreement,
// region existence, slice bounds and element alignment. Views pin their
// region, so the memory stays mapped while the view lives.
//
// Thread safety: the functions are safe for concurrent use; a view is a value
// owned by one request.
#ifndef QTX_SERVER_TENSOR_TENSOR_REF_H_
#define QTX_SERVER_TENSOR_TENSOR_REF_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/tensor/dtype.h"
#include "server/tensor/region_table.h"

namespace qtx::server::tensor {

// A byte range [offset, offset + size) of a registered region.
struct RegionSliceSpec {
  std::string region;
  uint64_t offset = 0;
  uint64_t size = 0;
};

// A tensor named by a request. `inline_data` borrows the request's bytes; the
// request must outlive the spec and every view resolved from it.
struct TensorRefSpec {
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  std::variant<std::monostate, std::string_view, RegionSliceSpec> data;
};

struct ShapeLimits {
  int max_rank = 8;
  int64_t max_elements = int64_t{1} << 34;
};

// A resolved, read-only input tensor.
struct TensorView {
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  int64_t elements = 0;
  const void* data = nullptr;  // aligned to the element size; null if byte_size == 0
  uint64_t byte_size = 0;
  MemoryKind memory = MemoryKind::kHost;
  std::shared_ptr<const Region> pin;  // set for region slices
  std::shared_ptr<const void> owned;  // set when inline bytes were re-aligned
};

// A resolved, writable output slice of a region.
struct OutputSlice {
  void* data = nullptr;
  uint64_t byte_size = 0;
  MemoryKind memory = MemoryKind::kHost;
  std::shared_ptr<const Region> pin;
  RegionSliceSpec spec;  // as the client named it
};

// Validates a shape and returns its element count.
// INVALID_ARGUMENT (naming `field`, e.g. "input.shape[1]=-3: dims must be >= 0")
// if the rank is outside 1..limits.max_rank, a dim is negative, or the
// element count overflows or exceeds limits.max_elements.
absl::StatusOr<int64_t> ValidateShape(std::span<const int64_t> shape, std::string_view field,
                                      const ShapeLimits& limits);

// Bytes of `elements` elements of `dtype`, overflow-checked.
// REQUIRES: elements >= 0. INVALID_ARGUMENT on overflow of int64.
absl::StatusOr<uint64_t> ByteCount(int64_t elements, DType dtype, std::string_view field);

// Resolves an input tensor. `field` prefixes messages ("input").
// INVALID_ARGUMENT: dtype unspecified, bad shape, no data, inline byte count
//   != elements * element size, slice size != that, slice beyond the region,
//   a region offset not aligned to the element size;
// NOT_FOUND: unknown region.
absl::StatusOr<TensorView> ResolveInput(const TensorRefSpec& spec, std::string_view field,
                                        const RegionTable& regions, const ShapeLimits& limits);

// Resolves a client-provided output slice that must hold exactly
// `needed_bytes`, aligned to `alignment` bytes. Errors as ResolveInput.
absl::StatusOr<OutputSlice> ResolveOutputSlice(const RegionSliceSpec& spec, uint64_t needed_bytes,
                                               uint64_t alignment, std::string_view field,
                                               const RegionTable& regions);

// True if the byte ranges [a, a+a_size) and [b, b+b_size) share a byte.
bool RangesOverlap(const void* a, uint64_t a_size, const void* b, uint64_t b_size);

}  // namespace qtx::server::tensor

#endif  // QTX_SERVER_TENSOR_TENSOR_REF_H_

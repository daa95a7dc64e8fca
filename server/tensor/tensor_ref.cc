#include "server/tensor/tensor_ref.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace qtx::server::tensor {
namespace {

// Locates [offset, offset + size) inside the pinned region, overflow-safe.
absl::StatusOr<std::byte*> LocateSlice(const Region& region, const RegionSliceSpec& spec,
                                       uint64_t alignment, std::string_view field) {
  const uint64_t region_size = region.byte_size();
  if (spec.offset > region_size || spec.size > region_size - spec.offset) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: region '%s': offset %d + size %d exceeds region size %d", field,
                        region.name(), spec.offset, spec.size, region_size));
  }
  std::byte* p = region.data() + spec.offset;
  if (alignment > 1 && reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    // A region's mapping starts on a page (shm) or allocation (CUDA) boundary
    // plus its registration offset, so the address's remainder is the
    // remainder of the slice's offset in the whole object.
    const bool shm = region.kind() == RegionKind::kShm;
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: region '%s': offset %d is not aligned to the %d-byte element size: the slice "
        "starts %d bytes past a multiple of %d in %s; tensor slices must start at multiples of "
        "the element size counted from the start of the %s (the region's registration offset "
        "plus the slice offset)",
        field, region.name(), spec.offset, alignment, reinterpret_cast<uintptr_t>(p) % alignment,
        alignment,
        shm ? absl::StrFormat("shm object '%s'", region.shm_name())
            : std::string("the CUDA allocation"),
        shm ? "shm object" : "CUDA allocation"));
  }
  return p;
}

}  // namespace

absl::StatusOr<int64_t> ValidateShape(std::span<const int64_t> shape, std::string_view field,
                                      const ShapeLimits& limits) {
  if (shape.empty() || shape.size() > static_cast<size_t>(limits.max_rank)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.shape: rank %d, must be 1..%d", field, shape.size(), limits.max_rank));
  }
  int64_t elements = 1;
  bool overflow = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.shape[%d]=%d: dims must be >= 0", field, i, shape[i]));
    }
    if (shape[i] > limits.max_elements) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.shape[%d]=%d: exceeds the element limit %d", field, i, shape[i],
                          limits.max_elements));
    }
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return int64_t{0};
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (__builtin_mul_overflow(elements, shape[i], &elements)) {
      overflow = true;
      break;
    }
  }
  if (overflow || elements > limits.max_elements) {
    std::string dims;
    for (size_t i = 0; i < shape.size(); ++i) {
      absl::StrAppendFormat(&dims, "%s%d", i ? "," : "", shape[i]);
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.shape=[%s]: %s elements, the limit is %d", field, dims,
                        overflow ? std::string("more than 2^63") : absl::StrFormat("%d", elements),
                        limits.max_elements));
  }
  return elements;
}

absl::StatusOr<uint64_t> ByteCount(int64_t elements, DType dtype, std::string_view field) {
  int64_t bytes = 0;
  if (elements < 0 || __builtin_mul_overflow(elements, ElementSize(dtype), &bytes)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d elements of %s overflow a 64-bit byte count", field, elements, DTypeName(dtype)));
  }
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<TensorView> ResolveInput(const TensorRefSpec& spec, std::string_view field,
                                        const RegionTable& regions, const ShapeLimits& limits) {
  if (spec.dtype == DType::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.dtype=DTYPE_UNSPECIFIED: the dtype must be set", field));
  }
  TensorView view;
  view.dtype = spec.dtype;
  view.shape = spec.shape;
  QTX_ASSIGN_OR_RETURN(view.elements, ValidateShape(spec.shape, field, limits));
  QTX_ASSIGN_OR_RETURN(view.byte_size, ByteCount(view.elements, spec.dtype, field));
  const uint64_t elem = static_cast<uint64_t>(ElementSize(spec.dtype));

  if (std::holds_alternative<std::monostate>(spec.data)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: no data: set inline_data or region", field));
  }
  if (const auto* bytes = std::get_if<std::string_view>(&spec.data)) {
    if (bytes->size() != view.byte_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.inline_data: %d bytes, expected %d (%d elements of %s)", field,
                          bytes->size(), view.byte_size, view.elements, DTypeName(spec.dtype)));
    }
    view.memory = MemoryKind::kHost;
    if (view.byte_size == 0) return view;
    if (reinterpret_cast<uintptr_t>(bytes->data()) % elem == 0) {
      view.data = bytes->data();
    } else {
      // Typed loads need element alignment; copy the (rare) misaligned case.
      std::shared_ptr<std::byte[]> copy(new std::byte[view.byte_size]);
      std::memcpy(copy.get(), bytes->data(), view.byte_size);
      view.data = copy.get();
      view.owned = std::move(copy);
    }
    return view;
  }
  const auto& slice = std::get<RegionSliceSpec>(spec.data);
  const std::string slice_field = absl::StrFormat("%s.region", field);
  if (slice.size != view.byte_size) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.size=%d: expected %d (%d elements of %s)",
                                                      slice_field, slice.size, view.byte_size,
                                                      view.elements, DTypeName(spec.dtype)));
  }
  auto pin = regions.Acquire(slice.region);
  if (!pin.ok()) {
    return absl::Status(pin.status().code(),
                        absl::StrFormat("%s: %s", slice_field, pin.status().message()));
  }
  QTX_ASSIGN_OR_RETURN(std::byte * p, LocateSlice(**pin, slice, elem, slice_field));
  view.data = view.byte_size == 0 ? nullptr : p;
  view.memory = (*pin)->memory_kind();
  view.pin = *std::move(pin);
  return view;
}

absl::StatusOr<OutputSlice> ResolveOutputSlice(const RegionSliceSpec& spec, uint64_t needed_bytes,
                                               uint64_t alignment, std::string_view field,
                                               const RegionTable& regions) {
  if (spec.size != needed_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.size=%d: expected %d", field, spec.size, needed_bytes));
  }
  auto pin = regions.Acquire(spec.region);
  if (!pin.ok()) {
    return absl::Status(pin.status().code(),
                        absl::StrFormat("%s: %s", field, pin.status().message()));
  }
  QTX_ASSIGN_OR_RETURN(std::byte * p, LocateSlice(**pin, spec, alignment, field));
  OutputSlice out;
  out.data = needed_bytes == 0 ? nullptr : p;
  out.byte_size = needed_bytes;
  out.memory = (*pin)->memory_kind();
  out.pin = *std::move(pin);
  out.spec = spec;
  return out;
}

bool RangesOverlap(const void* a, uint64_t a_size, const void* b, uint64_t b_size) {
  if (a == nullptr || b == nullptr || a_size == 0 || b_size == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a);
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + b_size && b0 < a0 + a_size;
}

}  // namespace qtx::server::tensor

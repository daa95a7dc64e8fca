// Plain C++ value types of the qtx client API: tensors, quantization configs
// and quantized tensors. They mirror the qtx.v1 messages (proto/qtx/v1) without
// exposing protobuf or gRPC to users of the client library.
//
// All types are regular values (copyable, movable, no hidden sharing); a
// single object may be read from several threads, but writes need external
// synchronization, like any std container.
#ifndef QTX_CLIENT_QTX_TYPES_H_
#define QTX_CLIENT_QTX_TYPES_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace qtx {

// Element types. The numeric values equal qtx.v1.DType.
enum class DType : int32_t {
  kUnspecified = 0,
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
  kFloat8E4M3 = 4,  // "e4m3fn": no Inf, max 448
  kFloat8E5M2 = 5,  // max 57344
  kUInt8 = 6,       // raw bytes
};

// Bytes per element: 4, 2, 2, 1, 1, 1; 0 for kUnspecified.
int64_t DTypeSize(DType dtype);
// "float32", "bfloat16", "float16", "float8_e4m3", "float8_e5m2", "uint8",
// "unspecified".
const char* DTypeName(DType dtype);

// Number of elements of `shape` (1 for rank 0).
// Fails with INVALID_ARGUMENT when a dim is negative or the product overflows
// int64.
absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape);

// A byte range [offset, offset + size) of a region registered with the
// server's Memory service.
struct RegionSlice {
  std::string region;  // the name given to Client::RegisterShmRegion
  uint64_t offset = 0;
  uint64_t size = 0;

  friend bool operator==(const RegionSlice&, const RegionSlice&) = default;
};

// A tensor: dtype, shape and where its bytes are. The bytes are either inline
// (`data`, little-endian, C order, exactly NumElements(shape) * DTypeSize(dtype)
// bytes) or in a registered region (`region` set; `data` is then ignored).
struct Tensor {
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  std::string data;                   // inline bytes, when !region
  std::optional<RegionSlice> region;  // set: the bytes live in this slice

  // Inline tensor owning `bytes`.
  static Tensor Inline(DType dtype, std::vector<int64_t> shape, std::string bytes);
  // Inline FLOAT32 tensor with a copy of `values`.
  // REQUIRES: values.size() equals the product of `shape`.
  static Tensor FromFloat32(std::vector<int64_t> shape, std::span<const float> values);
  // Tensor whose bytes are in `slice` of a registered region.
  static Tensor InRegion(DType dtype, std::vector<int64_t> shape, RegionSlice slice);

  bool in_region() const { return region.has_value(); }
  // Bytes the tensor occupies per its dtype and shape. Fails like NumElements.
  absl::StatusOr<int64_t> ByteSize() const;
};

// Block scaling mode (docs/numerics.md §2-§4).
enum class ScalingMode : int32_t {
  kBlock1D = 1,  // 1x128 rowwise blocks, 128x1 columnwise blocks
  kBlock2D = 2,  // 128x128 tiles
  // Per-tensor current scaling (TransformerEngine's Float8CurrentScaling):
  // one amax and one FP32 scale_inv of shape [1] per copy. Quantize,
  // Dequantize, AllGather and the Optimizer's FP8 output (not sharded).
  kTensor = 3,
};

enum class Fp8Format : int32_t {
  kE4M3 = 1,
  kE5M2 = 2,
};

const char* ScalingModeName(ScalingMode mode);  // "block1d" / "block2d" / "tensor"
const char* Fp8FormatName(Fp8Format format);    // "e4m3" / "e5m2"

// How to quantize. The defaults are the TransformerEngine recipe defaults.
struct QuantizeConfig {
  ScalingMode scaling_mode = ScalingMode::kBlock1D;
  Fp8Format format = Fp8Format::kE4M3;
  bool rowwise = true;      // produce the [M, N] copy
  bool columnwise = false;  // produce the transposed [N, M] copy
  bool force_pow2_scales = true;
  float amax_epsilon = 0.0f;  // must be finite and >= 0

  friend bool operator==(const QuantizeConfig&, const QuantizeConfig&) = default;
};

// Shapes (rows, cols) of the four buffers of a quantized [m, n] tensor in the
// GEMM-ready layouts of docs/numerics.md §4.1. Scale buffers are FLOAT32, data
// buffers FP8 (one byte per element).
struct QuantizedLayout {
  int64_t m = 0, n = 0;
  int64_t rowwise_data_rows = 0, rowwise_data_cols = 0;  // [M, N]
  int64_t rowwise_scale_rows = 0, rowwise_scale_cols = 0;
  int64_t columnwise_data_rows = 0, columnwise_data_cols = 0;  // [N, M]
  int64_t columnwise_scale_rows = 0, columnwise_scale_cols = 0;
};

// The layout of quantizing a tensor of `shape` (flattened to
// [prod(shape[:-1]), shape[-1]]) with `mode`.
// Fails with INVALID_ARGUMENT for rank 0, a negative dim, or overflow.
absl::StatusOr<QuantizedLayout> ComputeQuantizedLayout(ScalingMode mode,
                                                       std::span<const int64_t> shape);

// A block-scaled FP8 tensor as returned by Client::Quantize. Copies that were
// not requested are absent. Data tensors have dtype FLOAT8_E4M3/E5M2, scale
// tensors FLOAT32; each is inline or a slice of a caller-provided region.
struct QuantizedTensor {
  std::vector<int64_t> shape;  // logical shape of the high-precision tensor
  DType source_dtype = DType::kUnspecified;
  QuantizeConfig config;  // as the server applied it
  std::optional<Tensor> rowwise_data;
  std::optional<Tensor> rowwise_scale_inv;
  std::optional<Tensor> columnwise_data;
  std::optional<Tensor> columnwise_scale_inv;
};

// Where Client::Quantize writes its outputs: an unset slice means "return
// that buffer inline". A slice's size must equal the buffer's byte size.
struct QuantizeOutputs {
  std::optional<RegionSlice> rowwise_data;
  std::optional<RegionSlice> rowwise_scale_inv;
  std::optional<RegionSlice> columnwise_data;
  std::optional<RegionSlice> columnwise_scale_inv;
};

// A region as listed by the server.
struct RegionInfo {
  std::string name;
  std::string kind;  // "shm", "cuda_ipc" or "cuda_vmm"
  uint64_t byte_size = 0;
  std::string shm_name;   // shm regions
  int32_t device_id = 0;  // cuda_ipc and cuda_vmm regions
  uint32_t in_use = 0;    // requests currently using the region
};

}  // namespace qtx

#endif  // QTX_CLIENT_QTX_TYPES_H_

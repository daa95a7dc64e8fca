// Element types of tensors as the server sees them, independent of the
// protobuf enum (server/api converts). Pure functions; thread-safe.
#ifndef QTX_SERVER_TENSOR_DTYPE_H_
#define QTX_SERVER_TENSOR_DTYPE_H_

#include <cstdint>
#include <optional>
#include <string_view>

#include "kernels/quantize_params.h"

namespace qtx::server::tensor {

enum class DType : int32_t {
  kUnspecified = 0,
  kFloat32,
  kBFloat16,
  kFloat16,
  kFloat8E4M3,
  kFloat8E5M2,
  kUInt8,
};

// Bytes per element; 0 for kUnspecified.
int64_t ElementSize(DType t);

// "FLOAT32", "BFLOAT16", ... (the proto spelling), "DTYPE_UNSPECIFIED".
std::string_view DTypeName(DType t);

// The kernel input type for a high-precision dtype; nullopt for any other.
std::optional<kernels::InputDType> ToInputDType(DType t);

// The FP8 data dtype that holds `format`.
DType Fp8DataDType(kernels::Fp8Format format);

}  // namespace qtx::server::tensor

#endif  // QTX_SERVER_TENSOR_DTYPE_H_

#include "server/tensor/dtype.h"

namespace qtx::server::tensor {

int64_t ElementSize(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
    case DType::kUInt8:
      return 1;
    case DType::kUnspecified:
      return 0;
  }
  return 0;
}

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "FLOAT32";
    case DType::kBFloat16:
      return "BFLOAT16";
    case DType::kFloat16:
      return "FLOAT16";
    case DType::kFloat8E4M3:
      return "FLOAT8_E4M3";
    case DType::kFloat8E5M2:
      return "FLOAT8_E5M2";
    case DType::kUInt8:
      return "UINT8";
    case DType::kUnspecified:
      return "DTYPE_UNSPECIFIED";
  }
  return "DTYPE_INVALID";
}

std::optional<kernels::InputDType> ToInputDType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return kernels::InputDType::kFloat32;
    case DType::kBFloat16:
      return kernels::InputDType::kBFloat16;
    case DType::kFloat16:
      return kernels::InputDType::kFloat16;
    default:
      return std::nullopt;
  }
}

DType Fp8DataDType(kernels::Fp8Format format) {
  return format == kernels::Fp8Format::kE5M2 ? DType::kFloat8E5M2 : DType::kFloat8E4M3;
}

}  // namespace qtx::server::tensor

// Minimal reader and writer for NumPy's .npy format (versions 1.0-3.0), for
// the qtx CLI. Supported element types: little-endian float32 ('<f4'),
// float16 ('<f2') and uint8 ('|u1'), C order. NumPy has no bfloat16 dtype, so
// bf16 tensors cannot come from .npy files. Pure functions; thread-safe.
#ifndef QTX_CLIENT_CLI_NPY_H_
#define QTX_CLIENT_CLI_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "qtx/types.h"

namespace qtx::cli {

struct NpyArray {
  DType dtype = DType::kUnspecified;  // kFloat32, kFloat16 or kUInt8
  std::vector<int64_t> shape;
  std::string data;  // little-endian, C order
};

// Parses the contents of a .npy file. Fails with INVALID_ARGUMENT naming the
// problem: bad magic, malformed header, unsupported descr (e.g. '>f4', '<f8'),
// fortran_order True, or a data size that disagrees with the shape.
absl::StatusOr<NpyArray> ParseNpy(absl::string_view file);

// Reads and parses `path`. Fails with NOT_FOUND when it cannot be opened.
absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path);

// Serializes `array` as a version 1.0 .npy file.
// REQUIRES: array.dtype is kFloat32, kFloat16 or kUInt8; data size matches.
std::string SerializeNpy(const NpyArray& array);

}  // namespace qtx::cli

#endif  // QTX_CLIENT_CLI_NPY_H_

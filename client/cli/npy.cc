#include "client/cli/npy.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace qtx::cli {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

// Returns the text of the value that follows 'key': in the header dict,
// up to (not including) the next top-level ',' or '}' (a tuple counts as one
// value). Empty when the key is missing.
absl::string_view FindValue(absl::string_view header, absl::string_view key) {
  const std::string quoted_single = absl::StrCat("'", key, "'");
  const std::string quoted_double = absl::StrCat("\"", key, "\"");
  size_t pos = header.find(quoted_single);
  size_t len = quoted_single.size();
  if (pos == absl::string_view::npos) {
    pos = header.find(quoted_double);
    len = quoted_double.size();
  }
  if (pos == absl::string_view::npos) return {};
  size_t i = header.find(':', pos + len);
  if (i == absl::string_view::npos) return {};
  ++i;
  while (i < header.size() && std::isspace(static_cast<unsigned char>(header[i]))) ++i;
  size_t end = i;
  int depth = 0;
  while (end < header.size()) {
    const char c = header[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth == 0 && (c == ',' || c == '}')) break;
    ++end;
  }
  return absl::StripTrailingAsciiWhitespace(header.substr(i, end - i));
}

}  // namespace

absl::StatusOr<NpyArray> ParseNpy(absl::string_view file) {
  if (file.size() < kMagicLen + 4 || file.substr(0, kMagicLen) != absl::string_view(kMagic, 6)) {
    return absl::InvalidArgumentError("npy: not a .npy file (bad magic)");
  }
  const uint8_t major = static_cast<uint8_t>(file[6]);
  size_t header_len = 0;
  size_t header_start = 0;
  if (major == 1) {
    header_len =
        static_cast<uint8_t>(file[8]) | (static_cast<size_t>(static_cast<uint8_t>(file[9])) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (file.size() < 12) return absl::InvalidArgumentError("npy: truncated header");
    for (int b = 0; b < 4; ++b) {
      header_len |= static_cast<size_t>(static_cast<uint8_t>(file[8 + b])) << (8 * b);
    }
    header_start = 12;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("npy: format version ", major, " not supported (1, 2 or 3)"));
  }
  if (header_len > file.size() - header_start) {
    return absl::InvalidArgumentError("npy: truncated header");
  }
  const absl::string_view header = file.substr(header_start, header_len);

  NpyArray out;
  absl::string_view descr = FindValue(header, "descr");
  if (descr.size() < 2 || (descr.front() != '\'' && descr.front() != '"')) {
    return absl::InvalidArgumentError(absl::StrCat("npy: header has no 'descr': ", header));
  }
  descr = descr.substr(1, descr.size() - 2);
  if (descr == "<f4") {
    out.dtype = DType::kFloat32;
  } else if (descr == "<f2") {
    out.dtype = DType::kFloat16;
  } else if (descr == "|u1" || descr == "<u1") {
    out.dtype = DType::kUInt8;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("npy: descr '", descr,
                     "' not supported: use '<f4' (float32), '<f2' (float16) or '|u1' (uint8); "
                     "numpy has no bfloat16"));
  }
  const absl::string_view fortran = FindValue(header, "fortran_order");
  if (fortran == "True") {
    return absl::InvalidArgumentError(
        "npy: fortran_order True not supported; save with np.ascontiguousarray");
  }
  if (fortran != "False") {
    return absl::InvalidArgumentError(
        absl::StrCat("npy: header has no valid 'fortran_order': ", header));
  }
  absl::string_view shape_text = FindValue(header, "shape");
  if (!absl::ConsumePrefix(&shape_text, "(") || !absl::ConsumeSuffix(&shape_text, ")")) {
    return absl::InvalidArgumentError(absl::StrCat("npy: header has no valid 'shape': ", header));
  }
  for (absl::string_view part : absl::StrSplit(shape_text, ',', absl::SkipWhitespace())) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("npy: bad dim '", part, "' in shape"));
    }
    out.shape.push_back(d);
  }
  const Tensor probe = Tensor::InRegion(out.dtype, out.shape, {});
  absl::StatusOr<int64_t> bytes = probe.ByteSize();
  if (!bytes.ok()) return bytes.status();
  const absl::string_view payload = file.substr(header_start + header_len);
  if (payload.size() != static_cast<uint64_t>(*bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("npy: shape (", absl::StrJoin(out.shape, ","),
                                                   ") of ", DTypeName(out.dtype), " needs ", *bytes,
                                                   " data bytes, file has ", payload.size()));
  }
  out.data.assign(payload.data(), payload.size());
  return out;
}

absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  absl::StatusOr<NpyArray> array = ParseNpy(buffer.str());
  if (!array.ok()) {
    return absl::Status(array.status().code(), absl::StrCat(path, ": ", array.status().message()));
  }
  return array;
}

std::string SerializeNpy(const NpyArray& array) {
  const char* descr = array.dtype == DType::kFloat32   ? "<f4"
                      : array.dtype == DType::kFloat16 ? "<f2"
                                                       : "|u1";
  std::string shape = absl::StrJoin(array.shape, ", ");
  if (array.shape.size() == 1) shape += ",";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", shape, "), }");
  // Pad with spaces so that magic + 4 + header + '\n' is a multiple of 64.
  const size_t unpadded = kMagicLen + 4 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string out(kMagic, kMagicLen);
  out.push_back('\x01');
  out.push_back('\x00');
  out.push_back(static_cast<char>(header.size() & 0xFF));
  out.push_back(static_cast<char>((header.size() >> 8) & 0xFF));
  out += header;
  out += array.data;
  return out;
}

}  // namespace qtx::cli

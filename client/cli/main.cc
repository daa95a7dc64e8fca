// qtx: a command-line client for qtxd, for people.
//
//   qtx health   [--target=...]
//   qtx quantize [--npy=x.npy | --shape=MxN [--seed=S] [--dtype=float32|bfloat16]]
//                [--mode=1d|2d] [--format=e4m3|e5m2] [--usages=rowwise,columnwise]
//                [--pow2=true|false] [--eps=0] [--shm] [--save=PREFIX]
//   qtx regions  [--target=...]
//
// `quantize` sends the tensor to the server, prints the shapes of the outputs,
// the range of the scale_inv values and the error of dequantize(quantize(x))
// against x. .npy input: little-endian float32 ('<f4') or float16 ('<f2'), C
// order; numpy has no bfloat16, so bf16 input comes only from --dtype=bfloat16
// with a generated tensor. --save=PREFIX also writes the outputs as .npy files
// (PREFIX.rowwise_data.npy ... as '|u1' bytes and '<f4' scale_inv, plus
// PREFIX.dequantized.npy, the server's FP32 dequantization), for tools that
// have no gRPC (e.g. a GPU host's Python). Exit status: 0 on success, 1 on an RPC or input
// error (the status is printed to stderr), 2 on a usage error.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"
#include "absl/time/time.h"
#include "client/cli/npy.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"

ABSL_FLAG(std::string, target, std::string(qtx::kDefaultTarget),
          "qtxd address: unix:///path, an absolute socket path, or host:port");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(60), "deadline of each call");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token of a qtxd started with --auth_token_file");
ABSL_FLAG(bool, tls, false, "use TLS (host:port targets of a qtxd with --tls_cert_file)");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM roots of the server certificate (default: system)");
ABSL_FLAG(std::string, tls_cert_file, "", "client certificate (PEM) for mTLS");
ABSL_FLAG(std::string, tls_key_file, "", "client key (PEM) for mTLS");
ABSL_FLAG(std::string, tls_server_name, "", "name to check the server certificate against");
ABSL_FLAG(std::string, npy, "", "quantize: input .npy file ('<f4' or '<f2', C order)");
ABSL_FLAG(std::string, shape, "", "quantize: shape of a generated N(0,1) tensor, e.g. 256x1024");
ABSL_FLAG(uint64_t, seed, 0, "quantize: seed of the generated tensor");
ABSL_FLAG(std::string, dtype, "float32", "quantize: dtype of the generated tensor: float32|bfloat16");
ABSL_FLAG(std::string, mode, "1d", "quantize: scaling mode: 1d (1x128) | 2d (128x128)");
ABSL_FLAG(std::string, format, "e4m3", "quantize: FP8 format: e4m3 | e5m2");
ABSL_FLAG(std::string, usages, "rowwise", "quantize: comma list of rowwise, columnwise");
ABSL_FLAG(bool, pow2, true, "quantize: round scales down to powers of two");
ABSL_FLAG(float, eps, 0.0f, "quantize: amax epsilon");
ABSL_FLAG(bool, shm, false,
          "quantize: pass tensors through a shared-memory region (server needs "
          "--allow_client_shm) instead of inline bytes");
ABSL_FLAG(std::string, save, "",
          "quantize: also write the outputs as PREFIX.{rowwise_data,rowwise_scale_inv,"
          "columnwise_data,columnwise_scale_inv,dequantized}.npy (FP8 data as '|u1' bytes, "
          "scale_inv and the server's dequantization as '<f4')");

namespace qtx::cli {
namespace {

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1F;
  const uint32_t mant = h & 0x3FFu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    mag = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    mag = std::ldexp(static_cast<float>(mant | 0x400u), exp - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &mag, 4);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Round to nearest even; NaN stays a (quiet) NaN.
uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The elements of an inline FLOAT32/BFLOAT16/FLOAT16 tensor as floats.
std::vector<float> ToFloats(const Tensor& t) {
  std::vector<float> out;
  const int64_t size = DTypeSize(t.dtype);
  const size_t count = size ? t.data.size() / size : 0;
  out.resize(count);
  for (size_t i = 0; i < count; ++i) {
    if (t.dtype == DType::kFloat32) {
      std::memcpy(&out[i], t.data.data() + 4 * i, 4);
    } else {
      uint16_t v;
      std::memcpy(&v, t.data.data() + 2 * i, 2);
      out[i] = t.dtype == DType::kFloat16 ? HalfToFloat(v) : BFloat16ToFloat(v);
    }
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view text) {
  std::vector<int64_t> shape;
  for (absl::string_view part : absl::StrSplit(text, 'x')) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(part, &d) || d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shape=", text, ": expected dims like 256x1024"));
    }
    shape.push_back(d);
  }
  return shape;
}

absl::StatusOr<QuantizeConfig> ConfigFromFlags() {
  QuantizeConfig c;
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "1d" || mode == "block1d") {
    c.scaling_mode = ScalingMode::kBlock1D;
  } else if (mode == "2d" || mode == "block2d") {
    c.scaling_mode = ScalingMode::kBlock2D;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--mode=", mode, ": must be 1d or 2d"));
  }
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "e4m3") {
    c.format = Fp8Format::kE4M3;
  } else if (format == "e5m2") {
    c.format = Fp8Format::kE5M2;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--format=", format, ": must be e4m3 or e5m2"));
  }
  c.rowwise = false;
  for (absl::string_view u : absl::StrSplit(absl::GetFlag(FLAGS_usages), ',', absl::SkipEmpty())) {
    if (u == "rowwise") {
      c.rowwise = true;
    } else if (u == "columnwise") {
      c.columnwise = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--usages: '", u, "' is not rowwise or columnwise"));
    }
  }
  c.force_pow2_scales = absl::GetFlag(FLAGS_pow2);
  c.amax_epsilon = absl::GetFlag(FLAGS_eps);
  return c;
}

absl::StatusOr<Tensor> InputFromFlags() {
  const std::string npy = absl::GetFlag(FLAGS_npy);
  const std::string shape_text = absl::GetFlag(FLAGS_shape);
  if (npy.empty() == shape_text.empty()) {
    return absl::InvalidArgumentError("quantize: give exactly one of --npy or --shape");
  }
  if (!npy.empty()) {
    absl::StatusOr<NpyArray> array = ReadNpyFile(npy);
    if (!array.ok()) return array.status();
    if (array->dtype != DType::kFloat32 && array->dtype != DType::kFloat16) {
      return absl::InvalidArgumentError(
          absl::StrCat(npy, ": dtype ", DTypeName(array->dtype), " cannot be quantized"));
    }
    return Tensor::Inline(array->dtype, std::move(array->shape), std::move(array->data));
  }
  absl::StatusOr<std::vector<int64_t>> shape = ParseShape(shape_text);
  if (!shape.ok()) return shape.status();
  absl::StatusOr<int64_t> count = NumElements(*shape);
  if (!count.ok()) return count.status();
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(*count);
  for (float& v : values) v = normal(rng);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "float32") return Tensor::FromFloat32(*std::move(shape), values);
  if (dtype == "bfloat16") {
    std::string bytes(values.size() * 2, '\0');
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t b = FloatToBFloat16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
    return Tensor::Inline(DType::kBFloat16, *std::move(shape), std::move(bytes));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype=", dtype, ": must be float32 or bfloat16"));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Min and max of the non-padding scale_inv entries of a [rows, cols] scale
// matrix whose first `valid_cols` columns are real.
void ScaleRange(const Tensor& scales, int64_t valid_cols, float* lo, float* hi) {
  const std::vector<float> s = ToFloats(scales);
  const int64_t cols = scales.shape.size() == 2 ? scales.shape[1] : 0;
  for (size_t i = 0; cols > 0 && i < s.size(); ++i) {
    if (static_cast<int64_t>(i % cols) >= valid_cols) continue;
    *lo = std::min(*lo, s[i]);
    *hi = std::max(*hi, s[i]);
  }
}

absl::Status PrintStatus(const absl::Status& s) {
  if (!s.ok()) std::cerr << "qtx: " << s << "\n";
  return s;
}

// Reads a whole file named by a flag; NOT_FOUND names the flag and path.
absl::StatusOr<std::string> ReadFlagFile(const char* flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, "=", path, ": cannot read"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags() {
  ClientOptions options;
  options.timeout = absl::GetFlag(FLAGS_timeout);
  if (const std::string f = absl::GetFlag(FLAGS_token_file); !f.empty()) {
    absl::StatusOr<std::string> token = ReadFlagFile("token_file", f);
    if (!token.ok()) return token.status();
    options.auth_token = std::string(absl::StripAsciiWhitespace(*token));
  }
  options.tls = absl::GetFlag(FLAGS_tls);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  const struct {
    const char* flag;
    std::string path;
    std::string* dst;
  } files[] = {{"tls_ca_file", absl::GetFlag(FLAGS_tls_ca_file), &options.tls_root_certs_pem},
               {"tls_cert_file", absl::GetFlag(FLAGS_tls_cert_file), &options.tls_client_cert_pem},
               {"tls_key_file", absl::GetFlag(FLAGS_tls_key_file), &options.tls_client_key_pem}};
  for (const auto& file : files) {
    if (file.path.empty()) continue;
    absl::StatusOr<std::string> pem = ReadFlagFile(file.flag, file.path);
    if (!pem.ok()) return pem.status();
    *file.dst = *std::move(pem);
  }
  return Client::Connect(absl::GetFlag(FLAGS_target), options);
}

// Writes one inline tensor as PREFIX.NAME.npy; FP8 bytes are stored as uint8.
absl::Status SaveNpy(const std::string& prefix, absl::string_view name, const Tensor& t) {
  NpyArray array;
  switch (t.dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kUInt8:
      array.dtype = t.dtype;
      break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      array.dtype = DType::kUInt8;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("--save: ", name, " has dtype ", DTypeName(t.dtype),
                       ", which .npy cannot hold"));
  }
  array.shape = t.shape;
  array.data = t.data;
  const std::string path = absl::StrCat(prefix, ".", name, ".npy");
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const std::string bytes = SerializeNpy(array);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("--save: cannot write ", path));
  return absl::OkStatus();
}

absl::Status RunHealth() {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return client.status();
  absl::StatusOr<ServingStatus> s = (*client)->Health();
  if (!s.ok()) return s.status();
  std::cout << (*client)->target() << ": " << ServingStatusName(*s) << "\n";
  if (*s != ServingStatus::kServing) {
    return absl::UnavailableError(absl::StrCat("server is ", ServingStatusName(*s)));
  }
  return absl::OkStatus();
}

absl::Status RunRegions() {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return client.status();
  absl::StatusOr<std::vector<RegionInfo>> regions = (*client)->ListRegions();
  if (!regions.ok()) return regions.status();
  std::cout << absl::StrFormat("%-32s %-8s %14s %6s  %s\n", "NAME", "KIND", "BYTES", "IN_USE",
                               "SOURCE");
  for (const RegionInfo& r : *regions) {
    const std::string source =
        r.kind == "cuda_ipc" ? absl::StrCat("device ", r.device_id) : r.shm_name;
    std::cout << absl::StrFormat("%-32s %-8s %14d %6d  %s\n", r.name, r.kind, r.byte_size,
                                 r.in_use, source);
  }
  std::cout << regions->size() << " region(s)\n";
  return absl::OkStatus();
}

absl::Status RunQuantize() {
  absl::StatusOr<QuantizeConfig> config = ConfigFromFlags();
  if (!config.ok()) return config.status();
  absl::StatusOr<Tensor> input = InputFromFlags();
  if (!input.ok()) return input.status();
  absl::StatusOr<QuantizedLayout> layout =
      ComputeQuantizedLayout(config->scaling_mode, input->shape);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<std::unique_ptr<Client>> client_or = ConnectFromFlags();
  if (!client_or.ok()) return client_or.status();
  Client& client = **client_or;

  std::unique_ptr<ShmRegion> region;
  Tensor request_input = *input;
  QuantizeOutputs outputs;
  std::optional<RegionSlice> dequant_out;
  if (absl::GetFlag(FLAGS_shm)) {
    // Room for the input, the four outputs and the FP32 dequantized copy.
    const uint64_t elems = input->data.size() / DTypeSize(input->dtype);
    const uint64_t scales = 4 * (layout->rowwise_scale_rows * layout->rowwise_scale_cols +
                                 layout->columnwise_scale_rows * layout->columnwise_scale_cols);
    const uint64_t bytes = input->data.size() + 2 * elems + scales + 4 * elems + 6 * 64;
    absl::StatusOr<std::unique_ptr<ShmRegion>> r =
        ShmRegion::Create(absl::StrCat("qtx-cli-", getpid()), std::max<uint64_t>(bytes, 64));
    if (!r.ok()) return r.status();
    region = *std::move(r);
    absl::StatusOr<Tensor> placed = region->Place(*input);
    if (!placed.ok()) return placed.status();
    request_input = *std::move(placed);
    absl::StatusOr<QuantizeOutputs> outs =
        region->AllocateQuantizeOutputs(input->shape, *config);
    if (!outs.ok()) return outs.status();
    outputs = *std::move(outs);
    absl::StatusOr<Tensor> dq = region->AllocateTensor(DType::kFloat32, input->shape);
    if (!dq.ok()) return dq.status();
    dequant_out = dq->region;
    if (absl::Status s = client.RegisterShmRegion(*region); !s.ok()) return s;
  }
  // Unregisters the region on every path below.
  struct Unregister {
    Client& client;
    ShmRegion* region;
    ~Unregister() {
      if (region != nullptr) PrintStatus(client.UnregisterRegion(region->name())).IgnoreError();
    }
  } unregister{client, region.get()};

  const absl::Time start = absl::Now();
  absl::StatusOr<QuantizedTensor> q = client.Quantize(request_input, *config, outputs);
  if (!q.ok()) return q.status();
  const absl::Duration quantize_time = absl::Now() - start;
  absl::StatusOr<Tensor> dq = client.Dequantize(*q, DType::kFloat32, dequant_out);
  if (!dq.ok()) return dq.status();
  if (region != nullptr) {
    for (std::optional<Tensor>* t : {&q->rowwise_data, &q->rowwise_scale_inv,
                                     &q->columnwise_data, &q->columnwise_scale_inv}) {
      if (!t->has_value()) continue;
      absl::StatusOr<Tensor> copy = region->ToInline(**t);
      if (!copy.ok()) return copy.status();
      *t = *std::move(copy);
    }
    absl::StatusOr<Tensor> copy = region->ToInline(*dq);
    if (!copy.ok()) return copy.status();
    dq = *std::move(copy);
  }

  if (const std::string prefix = absl::GetFlag(FLAGS_save); !prefix.empty()) {
    const struct {
      const char* name;
      const std::optional<Tensor>* t;
    } outs[] = {{"rowwise_data", &q->rowwise_data},
                {"rowwise_scale_inv", &q->rowwise_scale_inv},
                {"columnwise_data", &q->columnwise_data},
                {"columnwise_scale_inv", &q->columnwise_scale_inv}};
    for (const auto& o : outs) {
      if (!o.t->has_value()) continue;
      if (absl::Status s = SaveNpy(prefix, o.name, **o.t); !s.ok()) return s;
    }
    if (absl::Status s = SaveNpy(prefix, "dequantized", *dq); !s.ok()) return s;
  }

  std::cout << absl::StrFormat("input        %s %s (%s)\n", DTypeName(input->dtype),
                               ShapeString(input->shape),
                               absl::GetFlag(FLAGS_shm) ? "shm region" : "inline");
  std::cout << absl::StrFormat(
      "config       mode=%s format=%s rowwise=%d columnwise=%d pow2=%d eps=%g\n",
      ScalingModeName(q->config.scaling_mode), Fp8FormatName(q->config.format), q->config.rowwise,
      q->config.columnwise, q->config.force_pow2_scales, q->config.amax_epsilon);
  const bool is_1d = q->config.scaling_mode == ScalingMode::kBlock1D;
  const int64_t mb = (layout->m + 127) / 128, nb = (layout->n + 127) / 128;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  auto print = [&](absl::string_view label, const std::optional<Tensor>& t) {
    if (t) {
      std::cout << absl::StrFormat("%-12s %s %s\n", label, DTypeName(t->dtype),
                                   ShapeString(t->shape));
    }
  };
  print("rowwise      data", q->rowwise_data);
  print("rowwise      scale_inv", q->rowwise_scale_inv);
  print("columnwise   data", q->columnwise_data);
  print("columnwise   scale_inv", q->columnwise_scale_inv);
  if (q->rowwise_scale_inv) ScaleRange(*q->rowwise_scale_inv, is_1d ? layout->m : nb, &lo, &hi);
  if (q->columnwise_scale_inv) {
    ScaleRange(*q->columnwise_scale_inv, is_1d ? layout->n : mb, &lo, &hi);
  }
  if (lo <= hi) {
    std::cout << absl::StrFormat("scale_inv    [%g, %g] (log2 [%g, %g])\n", lo, hi,
                                 std::log2(lo), std::log2(hi));
  }
  const std::vector<float> x = ToFloats(*input);
  const std::vector<float> y = ToFloats(*dq);
  if (x.size() != y.size()) {
    return absl::InternalError(absl::StrCat("dequantized ", y.size(), " elements, expected ",
                                            x.size()));
  }
  double max_abs = 0, err2 = 0, ref2 = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) continue;
    const double e = std::fabs(static_cast<double>(x[i]) - y[i]);
    max_abs = std::max(max_abs, e);
    err2 += e * e;
    ref2 += static_cast<double>(x[i]) * x[i];
  }
  std::cout << absl::StrFormat("dequant err  max_abs=%.6g rel_l2=%.6g (from the %s copy)\n",
                               max_abs, ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0,
                               q->rowwise_data ? "rowwise" : "columnwise");
  std::cout << absl::StrFormat("time         quantize %s\n", absl::FormatDuration(quantize_time));
  return absl::OkStatus();
}

}  // namespace
}  // namespace qtx::cli

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "qtx <health|quantize|regions> [flags]\n"
      "  qtx health                         ask qtxd whether it is serving\n"
      "  qtx quantize --shape=256x1024      quantize a random N(0,1) tensor\n"
      "  qtx quantize --npy=x.npy --mode=2d quantize a '<f4'/'<f2' .npy array\n"
      "  qtx regions                        list registered memory regions\n"
      "Use --helpfull for every flag.");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << absl::ProgramUsageMessage() << "\n";
    return 2;
  }
  const absl::string_view command = args[1];
  absl::Status status;
  if (command == "health") {
    status = qtx::cli::RunHealth();
  } else if (command == "quantize") {
    status = qtx::cli::RunQuantize();
  } else if (command == "regions") {
    status = qtx::cli::RunRegions();
  } else {
    std::cerr << "qtx: unknown command '" << command << "'\n"
              << absl::ProgramUsageMessage() << "\n";
    return 2;
  }
  return qtx::cli::PrintStatus(status).ok() ? 0 : 1;
}

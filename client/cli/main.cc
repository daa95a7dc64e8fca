// qtx: a command-line client for qtxd, for people.
//
//   qtx health   [--target=...] [--wait=60s]
//   qtx quantize [--npy=x.npy | --shape=MxN [--seed=S] [--dtype=float32|bfloat16]]
//                [--mode=1d|2d] [--format=e4m3|e5m2] [--usages=rowwise,columnwise]
//                [--pow2=true|false] [--eps=0] [--shm] [--save=PREFIX]
//   qtx regions  [--target=...]
//   qtx allgather --group=G --rank=R --world_size=W [--coordinator=T]
//                [--shape=MrxN [--seed=S] | --npy=shard.npy] [quantize flags]
//                [--gather_mode=exact|high_precision] [--sequence=K] [--keep_group]
//                [--shard_rows=M0,M1,...]
//   qtx step     --group=G [--shape=MxN] [--steps=K] [--seed=S] [--lr=X] [--checkpoint]
//                [--max_grad_norm=X] [--two_phase]
//                [--shard=BEGIN:END --dp_group=D --rank=R --world_size=W [--coordinator=T]
//                 [--sequence=K] [--gather]]
//   qtx groups   [--destroy=G] [--release=G]
//
// `allgather` joins (or reuses) the collective group G on its sidecar and
// all-gathers this rank's shard; every rank runs it against its own qtxd. With
// a generated shard (rank r uses seed S + r) it checks the result against
// Quantize of the concatenated shards, which it can rebuild from the shard
// sizes every rank reports. `step` offloads a one-parameter AdamW group G when
// it does not exist yet, runs K steps with generated gradients from the
// group's step on, and checks the FP8 parameters against Quantize of the
// master weights; --two_phase measures each step's gradient norm with
// GradNorm first and passes the clip factor (from --max_grad_norm) and skip
// to Step, as a trainer does after reducing the norms over its ranks. `groups` lists the collective
// and optimizer groups, or destroys a collective group / releases an optimizer group.
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
#include <unistd.h>

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
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "client/cli/npy.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"

ABSL_FLAG(std::string, target, std::string(qtx::kDefaultTarget),
          "qtxd address: unix:///path, an absolute socket path, or host:port");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(60), "deadline of each call");
ABSL_FLAG(absl::Duration, wait, absl::ZeroDuration(),
          "health: ask until qtxd is SERVING, up to this long (a script or init container waiting "
          "for its sidecar); 0: ask once");
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
ABSL_FLAG(std::string, dtype, "float32",
          "quantize: dtype of the generated tensor: float32|bfloat16");
ABSL_FLAG(std::string, mode, "1d",
          "quantize: scaling mode: 1d (1x128) | 2d (128x128) | tensor (per-tensor current "
          "scaling)");
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
ABSL_FLAG(std::string, group, "", "allgather, step: the group's name");
ABSL_FLAG(int32_t, rank, 0, "allgather: this rank, 0..world_size-1");
ABSL_FLAG(int32_t, world_size, 1, "allgather: number of ranks");
ABSL_FLAG(std::string, coordinator, "",
          "allgather: rank 0's qtxd as this rank's qtxd reaches it (unix:/path or host:port); "
          "empty on rank 0");
ABSL_FLAG(std::string, backend, "auto", "allgather: auto | gloo | nccl");
ABSL_FLAG(absl::Duration, group_timeout, absl::Seconds(60),
          "allgather: how long CreateGroup waits for every rank to join");
ABSL_FLAG(std::string, gather_mode, "exact", "allgather: exact (FP8) | high_precision");
ABSL_FLAG(uint64_t, sequence, 0,
          "allgather, step --dp_group: the Collective group's call counter (0 for the first "
          "call)");
ABSL_FLAG(bool, keep_group, false,
          "allgather: leave the group on the sidecar (default: destroy a group this call made)");
ABSL_FLAG(std::vector<std::string>, shard_rows, {},
          "allgather: every rank's M_r, comma-separated, the same on every rank: one collective "
          "round, no shape exchange (give it on every rank or on none)");
ABSL_FLAG(int32_t, steps, 1, "step: number of optimizer steps to run");
ABSL_FLAG(double, lr, 0.0, "step: learning rate for these steps (0: the group's)");
ABSL_FLAG(bool, checkpoint, false, "step: SaveCheckpoint after the steps (qtxd --checkpoint_dir)");
ABSL_FLAG(double, max_grad_norm, 0.0,
          "step: clip the gradients to this global L2 norm (0: no clipping)");
ABSL_FLAG(bool, two_phase, false,
          "step: GradNorm first, then Step with the clip factor and skip it implies (the "
          "two-phase step of a trainer whose parameters span several groups or ranks)");
ABSL_FLAG(std::string, shard, "",
          "step: BEGIN:END, offload the parameter data-parallel sharded: this sidecar owns its "
          "flattened elements [BEGIN, END) (every rank generates the whole tensors from --seed and "
          "keeps its slice); needs --dp_group");
ABSL_FLAG(std::string, dp_group, "",
          "step: the Collective group of the owners' sidecars a sharded Step runs over (joined "
          "as --rank of --world_size via --coordinator when absent, and kept); its calls use "
          "--sequence, --sequence + 1, ...");
ABSL_FLAG(bool, gather, false,
          "step --shard: after the steps, all-gather each parameter's FP8 shards from every "
          "owner (AllGatherParameter, on --dp_group with the sequence numbers after the steps') "
          "and print the whole rowwise copy");
ABSL_FLAG(std::string, destroy, "", "groups: destroy this collective group on the sidecar");
ABSL_FLAG(std::string, release, "",
          "groups: release this optimizer group (frees its memory, deletes its checkpoints)");

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
  } else if (mode == "tensor") {
    c.scaling_mode = ScalingMode::kTensor;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--mode=", mode, ": must be 1d, 2d or tensor"));
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

// A tensor of N(0, 1) * `stddev` values from the seed, as float32 or
// bfloat16 (rounded to nearest even). The same arguments give the same bytes
// in every process (std::mt19937_64 and std::normal_distribution of libstdc++).
absl::StatusOr<Tensor> Generate(std::vector<int64_t> shape, uint64_t seed, const std::string& dtype,
                                float stddev = 1.0f) {
  absl::StatusOr<int64_t> count = NumElements(shape);
  if (!count.ok()) return count.status();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(*count);
  for (float& v : values) v = normal(rng) * stddev;
  if (dtype == "float32") return Tensor::FromFloat32(std::move(shape), values);
  if (dtype == "bfloat16") {
    std::string bytes(values.size() * 2, '\0');
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t b = FloatToBFloat16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
    return Tensor::Inline(DType::kBFloat16, std::move(shape), std::move(bytes));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype=", dtype, ": must be float32 or bfloat16"));
}

absl::StatusOr<Tensor> InputFromFlags() {
  const std::string npy = absl::GetFlag(FLAGS_npy);
  const std::string shape_text = absl::GetFlag(FLAGS_shape);
  if (npy.empty() == shape_text.empty()) {
    return absl::InvalidArgumentError("give exactly one of --npy or --shape");
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
  return Generate(*std::move(shape), absl::GetFlag(FLAGS_seed), absl::GetFlag(FLAGS_dtype));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Min and max of the non-padding scale_inv entries of a [rows, cols] scale
// matrix whose first `valid_cols` columns are real.
void ScaleRange(const Tensor& scales, int64_t valid_cols, float* lo, float* hi) {
  const std::vector<float> s = ToFloats(scales);
  const int64_t cols = scales.shape.empty() ? 0 : scales.shape.back();  // [1] for tensor
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
      return absl::InvalidArgumentError(absl::StrCat(
          "--save: ", name, " has dtype ", DTypeName(t.dtype), ", which .npy cannot hold"));
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
  const absl::Duration wait = absl::GetFlag(FLAGS_wait);
  if (wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--wait=", absl::FormatDuration(wait), ": must not be negative"));
  }
  if (wait > absl::ZeroDuration()) {
    const absl::Status serving = (*client)->WaitUntilServing(wait);
    if (!serving.ok()) return serving;
  }
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
    std::cout << absl::StrFormat("%-32s %-8s %14d %6d  %s\n", r.name, r.kind, r.byte_size, r.in_use,
                                 source);
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
    absl::StatusOr<QuantizeOutputs> outs = region->AllocateQuantizeOutputs(input->shape, *config);
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
    for (std::optional<Tensor>* t :
         {&q->rowwise_data, &q->rowwise_scale_inv, &q->columnwise_data, &q->columnwise_scale_inv}) {
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
  const bool is_tensor = q->config.scaling_mode == ScalingMode::kTensor;
  if (q->rowwise_scale_inv) {
    ScaleRange(*q->rowwise_scale_inv, is_tensor ? 1 : is_1d ? layout->m : nb, &lo, &hi);
  }
  if (q->columnwise_scale_inv) {
    ScaleRange(*q->columnwise_scale_inv, is_tensor ? 1 : is_1d ? layout->n : mb, &lo, &hi);
  }
  if (lo <= hi) {
    std::cout << absl::StrFormat("scale_inv    [%g, %g] (log2 [%g, %g])\n", lo, hi, std::log2(lo),
                                 std::log2(hi));
  }
  const std::vector<float> x = ToFloats(*input);
  const std::vector<float> y = ToFloats(*dq);
  if (x.size() != y.size()) {
    return absl::InternalError(
        absl::StrCat("dequantized ", y.size(), " elements, expected ", x.size()));
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

// Prints the shapes and the scale_inv range of a quantized tensor.
void PrintQuantized(const QuantizedTensor& q) {
  const absl::StatusOr<QuantizedLayout> layout =
      ComputeQuantizedLayout(q.config.scaling_mode, q.shape);
  auto print = [](absl::string_view label, const std::optional<Tensor>& t) {
    if (t) {
      std::cout << absl::StrFormat("%-22s %s %s\n", label, DTypeName(t->dtype),
                                   ShapeString(t->shape));
    }
  };
  print("rowwise    data", q.rowwise_data);
  print("rowwise    scale_inv", q.rowwise_scale_inv);
  print("columnwise data", q.columnwise_data);
  print("columnwise scale_inv", q.columnwise_scale_inv);
  if (!layout.ok()) return;
  const bool is_1d = q.config.scaling_mode == ScalingMode::kBlock1D;
  const int64_t mb = (layout->m + 127) / 128, nb = (layout->n + 127) / 128;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  const bool is_tensor = q.config.scaling_mode == ScalingMode::kTensor;
  if (q.rowwise_scale_inv) {
    ScaleRange(*q.rowwise_scale_inv, is_tensor ? 1 : is_1d ? layout->m : nb, &lo, &hi);
  }
  if (q.columnwise_scale_inv) {
    ScaleRange(*q.columnwise_scale_inv, is_tensor ? 1 : is_1d ? layout->n : mb, &lo, &hi);
  }
  if (lo <= hi) std::cout << absl::StrFormat("%-22s [%g, %g]\n", "scale_inv range", lo, hi);
}

// "" when both tensors hold the same copies with identical bytes; else what
// differs first.
std::string FirstDifference(const QuantizedTensor& a, const QuantizedTensor& b) {
  if (a.shape != b.shape) {
    return absl::StrCat("shape ", ShapeString(a.shape), " vs ", ShapeString(b.shape));
  }
  const struct {
    const char* name;
    const std::optional<Tensor>& x;
    const std::optional<Tensor>& y;
  } parts[] = {{"rowwise_data", a.rowwise_data, b.rowwise_data},
               {"rowwise_scale_inv", a.rowwise_scale_inv, b.rowwise_scale_inv},
               {"columnwise_data", a.columnwise_data, b.columnwise_data},
               {"columnwise_scale_inv", a.columnwise_scale_inv, b.columnwise_scale_inv}};
  for (const auto& part : parts) {
    if (part.x.has_value() != part.y.has_value()) {
      return absl::StrCat(part.name, " present in only one");
    }
    if (!part.x) continue;
    if (part.x->shape != part.y->shape) {
      return absl::StrCat(part.name, " shape ", ShapeString(part.x->shape), " vs ",
                          ShapeString(part.y->shape));
    }
    const std::string& u = part.x->data;
    const std::string& v = part.y->data;
    if (u.size() != v.size()) return absl::StrCat(part.name, " byte count differs");
    const auto diff = std::mismatch(u.begin(), u.end(), v.begin());
    if (diff.first != u.end()) {
      return absl::StrCat(part.name, " byte ", diff.first - u.begin(), " differs");
    }
  }
  return "";
}

// The group's name from --group; INVALID_ARGUMENT names the command.
absl::StatusOr<std::string> GroupFromFlags(absl::string_view command) {
  std::string group = absl::GetFlag(FLAGS_group);
  if (group.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(command, ": --group is required"));
  }
  return group;
}

// Joins the Collective group `name` as --rank of --world_size (coordinator,
// timeout from the flags), or reuses it when this sidecar already has it
// (e.g. from allgather --keep_group). Returns whether it was created.
absl::StatusOr<bool> JoinCollectiveGroup(Client& client, const std::string& name, int32_t rank,
                                         CommBackend backend) {
  absl::StatusOr<std::vector<CollectiveGroupInfo>> groups = client.ListGroups();
  if (!groups.ok()) return groups.status();
  const auto existing = std::find_if(groups->begin(), groups->end(),
                                     [&](const CollectiveGroupInfo& g) { return g.name == name; });
  if (existing != groups->end()) {
    std::cout << absl::StrFormat("group      '%s' reused: rank %d of %d, backend %s, state %s\n",
                                 existing->name, existing->rank, existing->world_size,
                                 CommBackendName(existing->backend),
                                 GroupStateName(existing->state));
    return false;
  }
  CollectiveGroupConfig gc;
  gc.name = name;
  gc.rank = rank;
  gc.world_size = absl::GetFlag(FLAGS_world_size);
  gc.coordinator = absl::GetFlag(FLAGS_coordinator);
  gc.backend = backend;
  gc.timeout = absl::GetFlag(FLAGS_group_timeout);
  CallOptions call;
  call.timeout = gc.timeout + absl::Seconds(10);
  absl::StatusOr<CollectiveGroupInfo> info = client.CreateGroup(gc, call);
  if (!info.ok()) return info.status();
  std::cout << absl::StrFormat("group      '%s' created: rank %d of %d, backend %s\n", info->name,
                               info->rank, info->world_size, CommBackendName(info->backend));
  return true;
}

absl::Status RunAllGather() {
  absl::StatusOr<std::string> group = GroupFromFlags("allgather");
  if (!group.ok()) return group.status();
  absl::StatusOr<QuantizeConfig> config = ConfigFromFlags();
  if (!config.ok()) return config.status();
  const int32_t rank = absl::GetFlag(FLAGS_rank);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const bool generated = absl::GetFlag(FLAGS_npy).empty();
  absl::StatusOr<Tensor> shard;
  if (generated && !absl::GetFlag(FLAGS_shape).empty()) {
    // Rank r's shard comes from seed + r, so any rank can rebuild all shards.
    absl::StatusOr<std::vector<int64_t>> shape = ParseShape(absl::GetFlag(FLAGS_shape));
    if (!shape.ok()) return shape.status();
    if (shape->size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("--shape=", absl::GetFlag(FLAGS_shape),
                                                     ": allgather takes a shard MrxN (two dims)"));
    }
    shard =
        Generate(*std::move(shape), seed + static_cast<uint64_t>(rank), absl::GetFlag(FLAGS_dtype));
  } else {
    shard = InputFromFlags();
  }
  if (!shard.ok()) return shard.status();
  CommBackend backend;
  const std::string backend_name = absl::GetFlag(FLAGS_backend);
  if (backend_name == "auto") {
    backend = CommBackend::kUnspecified;
  } else if (backend_name == "gloo") {
    backend = CommBackend::kGloo;
  } else if (backend_name == "nccl") {
    backend = CommBackend::kNccl;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", backend_name, ": must be auto, gloo or nccl"));
  }
  AllGatherMode mode;
  const std::string mode_name = absl::GetFlag(FLAGS_gather_mode);
  if (mode_name == "exact") {
    mode = AllGatherMode::kExactFp8;
  } else if (mode_name == "high_precision") {
    mode = AllGatherMode::kGatherHighPrecision;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--gather_mode=", mode_name, ": must be exact or high_precision"));
  }
  absl::StatusOr<std::unique_ptr<Client>> client_or = ConnectFromFlags();
  if (!client_or.ok()) return client_or.status();
  Client& client = **client_or;

  absl::StatusOr<bool> created_or = JoinCollectiveGroup(client, *group, rank, backend);
  if (!created_or.ok()) return created_or.status();
  const bool created = *created_or;
  // Destroys a group this call created, on every path below, unless kept.
  struct Destroy {
    Client& client;
    std::string name;
    bool active;
    ~Destroy() {
      if (active) PrintStatus(client.DestroyGroup(name)).IgnoreError();
    }
  } destroy{client, *group, created && !absl::GetFlag(FLAGS_keep_group)};

  std::vector<int64_t> shard_rows;
  for (const std::string& v : absl::GetFlag(FLAGS_shard_rows)) {
    int64_t m = 0;
    if (!absl::SimpleAtoi(v, &m)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shard_rows: '", v, "' is not an integer (expected M0,M1,...)"));
    }
    shard_rows.push_back(m);
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<AllGatherResult> r = client.AllGather(*group, absl::GetFlag(FLAGS_sequence),
                                                       *shard, *config, mode, {}, {}, shard_rows);
  if (!r.ok()) return r.status();
  const absl::Duration elapsed = absl::Now() - start;
  std::cout << absl::StrFormat("shard      %s %s (rank %d)\n", DTypeName(shard->dtype),
                               ShapeString(shard->shape), rank);
  std::cout << absl::StrFormat("shard_rows %s\n", ShapeString(r->shard_rows));
  std::cout << absl::StrFormat("gathered   %s, mode=%s format=%s, %s\n",
                               ShapeString(r->tensor.shape),
                               ScalingModeName(r->tensor.config.scaling_mode),
                               Fp8FormatName(r->tensor.config.format), AllGatherModeName(mode));
  PrintQuantized(r->tensor);
  std::cout << absl::StrFormat("time       %s\n", absl::FormatDuration(elapsed));

  if (!generated) {
    std::cout << "check      skipped (--npy shard: the other ranks' shards are unknown here)\n";
    return absl::OkStatus();
  }
  // Rebuild every rank's shard and quantize their concatenation on this sidecar.
  std::vector<int64_t> row_shape = shard->shape;
  std::string all;
  std::vector<int64_t> total_shape = shard->shape;
  int64_t total_rows = 0;
  for (size_t k = 0; k < r->shard_rows.size(); ++k) {
    row_shape[0] = r->shard_rows[k];
    absl::StatusOr<Tensor> part = Generate(row_shape, seed + k, absl::GetFlag(FLAGS_dtype));
    if (!part.ok()) return part.status();
    all += part->data;
    total_rows += r->shard_rows[k];
  }
  total_shape[0] = total_rows;
  absl::StatusOr<QuantizedTensor> whole =
      client.Quantize(Tensor::Inline(shard->dtype, total_shape, std::move(all)), *config);
  if (!whole.ok()) return whole.status();
  const std::string diff = FirstDifference(r->tensor, *whole);
  if (!diff.empty()) {
    return absl::InternalError(
        absl::StrCat("the gathered tensor differs from Quantize(concat of the shards): ", diff));
  }
  std::cout << "check      identical to Quantize(concat of the shards)\n";
  return absl::OkStatus();
}

absl::Status RunStep() {
  absl::StatusOr<std::string> group = GroupFromFlags("step");
  if (!group.ok()) return group.status();
  const int32_t steps = absl::GetFlag(FLAGS_steps);
  if (steps < 1) return absl::InvalidArgumentError("--steps: must be >= 1");
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<std::unique_ptr<Client>> client_or = ConnectFromFlags();
  if (!client_or.ok()) return client_or.status();
  Client& client = **client_or;

  absl::StatusOr<OptimizerGroupList> list = client.ListOptimizerGroups();
  if (!list.ok()) return list.status();
  const auto it = std::find_if(list->groups.begin(), list->groups.end(),
                               [&](const OptimizerGroupInfo& g) { return g.name == *group; });
  // Data-parallel sharding: this sidecar's range of the whole parameter.
  std::optional<ShardRange> shard;
  const std::string dp_group = absl::GetFlag(FLAGS_dp_group);
  if (const std::string text = absl::GetFlag(FLAGS_shard); !text.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(text, ':');
    ShardRange r;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r.begin) ||
        !absl::SimpleAtoi(parts[1], &r.end)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shard=", text, ": must be BEGIN:END (element offsets)"));
    }
    if (dp_group.empty()) {
      return absl::InvalidArgumentError(
          "--shard needs --dp_group (the Collective group of the owners' sidecars)");
    }
    shard = r;
  }
  const std::string shape_text =
      absl::GetFlag(FLAGS_shape).empty() ? "256x512" : absl::GetFlag(FLAGS_shape);
  absl::StatusOr<std::vector<int64_t>> whole_shape = ParseShape(shape_text);
  if (!whole_shape.ok()) return whole_shape.status();
  // A tensor of the whole parameter's shape generated from `s`, or this
  // sidecar's slice of it when sharded.
  auto generate = [&](uint64_t s, float stddev) -> absl::StatusOr<Tensor> {
    absl::StatusOr<Tensor> t = Generate(*whole_shape, s, "float32", stddev);
    if (!t.ok() || !shard.has_value()) return t;
    if (shard->begin < 0 || shard->begin > shard->end ||
        static_cast<size_t>(shard->end) * 4 > t->data.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--shard=%d:%d: outside the parameter's %d elements (--shape=%s)",
                          shard->begin, shard->end, t->data.size() / 4, shape_text));
    }
    return Tensor::Inline(DType::kFloat32, {shard->end - shard->begin},
                          t->data.substr(4 * shard->begin, 4 * (shard->end - shard->begin)));
  };
  if (!dp_group.empty()) {
    absl::StatusOr<bool> joined =
        JoinCollectiveGroup(client, dp_group, absl::GetFlag(FLAGS_rank), CommBackend::kUnspecified);
    if (!joined.ok()) return joined.status();
  }
  OptimizerGroupInfo info;
  if (it == list->groups.end()) {
    absl::StatusOr<Tensor> master = generate(seed, 0.02f);
    if (!master.ok()) return master.status();
    OptimizerGroupConfig gc;
    gc.group = *group;
    OptimizerParameterInit param;
    param.name = "w";
    param.shape = *whole_shape;
    param.master = *master;
    param.shard = shard;
    absl::StatusOr<OptimizerGroupInfo> made = client.OffloadOptimizerState(gc, {param});
    if (!made.ok()) return made.status();
    info = *std::move(made);
    std::cout << absl::StrFormat("group   '%s' offloaded: parameter w %s, AdamW lr=%g\n", info.name,
                                 ShapeString(*whole_shape), info.hyper_params.lr);
  } else {
    info = *it;
    if (!info.error.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("group '", info.name, "' is unusable: ", info.error));
    }
    std::cout << absl::StrFormat("group   '%s' found at step %d (%d parameters)\n", info.name,
                                 info.step, info.num_parameters);
  }
  // The parameters' names and shapes, from the state itself.
  absl::StatusOr<OptimizerState> state = client.GetState(*group);
  if (!state.ok()) return state.status();

  StepOptions options;
  if (const double lr = absl::GetFlag(FLAGS_lr); lr != 0.0) options.lr = lr;
  const double max_grad_norm = absl::GetFlag(FLAGS_max_grad_norm);
  const bool two_phase = absl::GetFlag(FLAGS_two_phase);
  if (max_grad_norm != 0.0 && !two_phase) options.max_grad_norm = max_grad_norm;
  absl::StatusOr<OptimizerStepResult> last;
  for (int32_t k = 1; k <= steps; ++k) {
    const int64_t step = info.step + k;
    std::vector<OptimizerGradient> grads;
    for (const OptimizerParameterState& p : state->parameters) {
      absl::StatusOr<Tensor> g =
          shard.has_value()
              ? generate(seed + static_cast<uint64_t>(step), 0.01f)
              : Generate(p.master.shape, seed + static_cast<uint64_t>(step), "float32", 0.01f);
      if (!g.ok()) return g.status();
      grads.push_back({p.name, *std::move(g)});
    }
    if (!dp_group.empty()) {
      options.collective_group = dp_group;
      options.sequence = absl::GetFlag(FLAGS_sequence) + static_cast<uint64_t>(k - 1);
    }
    if (two_phase) {
      // One group here; a trainer adds sum_squares (and ors non_finite) over
      // every group of every rank before deciding.
      absl::StatusOr<GradNormResult> norm = client.GradNorm(*group, step, grads, {});
      if (!norm.ok()) return norm.status();
      std::cout << absl::StrFormat("norm    %d: sum_squares=%.9g grad_norm=%.6g non_finite=%d\n",
                                   norm->step, norm->sum_squares, norm->grad_norm,
                                   norm->non_finite);
      options.skip = norm->non_finite;
      options.clip_factor =
          max_grad_norm != 0.0 ? ClipFactor(norm->sum_squares, max_grad_norm) : 1.0;
    }
    CallOptions step_call;
    if (!dp_group.empty()) step_call.timeout = absl::GetFlag(FLAGS_group_timeout);
    last = client.Step(*group, step, grads, options, step_call);
    if (!last.ok()) return last.status();
    const OptimizerStepStats& st = last->stats;
    std::cout << absl::StrFormat(
        "step    %d: grad_norm=%.6g lr=%g clip_coef=%g skipped=%d replayed=%d\n", st.step,
        st.grad_norm, st.lr, st.clip_coef, st.skipped, st.replayed);
  }
  // The FP8 parameters must be Quantize(master weights) with the group's config.
  absl::StatusOr<OptimizerState> after = client.GetState(*group);
  if (!after.ok()) return after.status();
  int checked = 0;
  uint64_t gather_sequence = absl::GetFlag(FLAGS_sequence) + static_cast<uint64_t>(steps);
  for (const ParameterOutput& out : last->parameters) {
    if (!out.fp8) continue;
    if (shard.has_value()) {
      // This sidecar's FP8 shard: its elements' bytes and the whole scales
      // (checked against the unsharded result by the e2e tests).
      std::cout << absl::StrFormat("shard   %s [%d, %d) of %s: %d FP8 bytes\n", out.name,
                                   shard->begin, shard->end, ShapeString(out.fp8->shape),
                                   out.fp8->rowwise_data ? out.fp8->rowwise_data->data.size() : 0);
      PrintQuantized(*out.fp8);
      if (absl::GetFlag(FLAGS_gather)) {
        CallOptions gather_call;
        gather_call.timeout = absl::GetFlag(FLAGS_group_timeout);
        absl::StatusOr<ParameterAllGatherResult> g = client.AllGatherParameter(
            dp_group, gather_sequence++, *out.fp8, *shard, {}, gather_call, out.name);
        if (!g.ok()) return g.status();
        std::string ranges;
        for (const ShardRange& r : g->ranges) {
          absl::StrAppend(&ranges, ranges.empty() ? "" : " ", "[", r.begin, ",", r.end, ")");
        }
        std::cout << absl::StrFormat("gathered %s %s from ranges %s\n", out.name,
                                     ShapeString(g->tensor.shape), ranges);
        PrintQuantized(g->tensor);
        // This owner's bytes must sit at their place, with the same scales.
        if (!g->tensor.rowwise_data || !out.fp8->rowwise_data ||
            g->tensor.rowwise_data->data.substr(shard->begin, shard->end - shard->begin) !=
                out.fp8->rowwise_data->data ||
            !g->tensor.rowwise_scale_inv || !out.fp8->rowwise_scale_inv ||
            g->tensor.rowwise_scale_inv->data != out.fp8->rowwise_scale_inv->data) {
          return absl::InternalError(absl::StrCat(
              "parameter '", out.name, "': the gathered tensor does not hold this owner's shard"));
        }
      }
      continue;
    }
    const auto p =
        std::find_if(after->parameters.begin(), after->parameters.end(),
                     [&](const OptimizerParameterState& s) { return s.name == out.name; });
    if (p == after->parameters.end()) {
      return absl::InternalError(absl::StrCat("GetState has no parameter '", out.name, "'"));
    }
    std::cout << absl::StrFormat("param   %s %s\n", out.name, ShapeString(out.fp8->shape));
    PrintQuantized(*out.fp8);
    absl::StatusOr<QuantizedTensor> q = client.Quantize(p->master, out.fp8->config);
    if (!q.ok()) return q.status();
    const std::string diff = FirstDifference(*out.fp8, *q);
    if (!diff.empty()) {
      return absl::InternalError(absl::StrCat(
          "parameter '", out.name, "': FP8 output differs from Quantize(master): ", diff));
    }
    ++checked;
  }
  if (checked > 0) {
    std::cout << absl::StrFormat("check   %d FP8 parameter(s) identical to Quantize(master)\n",
                                 checked);
  }
  if (absl::GetFlag(FLAGS_checkpoint)) {
    absl::StatusOr<std::vector<CheckpointInfo>> saved = client.SaveCheckpoint(*group);
    if (!saved.ok()) return saved.status();
    for (const CheckpointInfo& c : *saved) {
      std::cout << absl::StrFormat("checkpoint %s at step %d: %s (%d bytes)\n", c.group, c.step,
                                   c.path, c.bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status RunGroups() {
  absl::StatusOr<std::unique_ptr<Client>> client_or = ConnectFromFlags();
  if (!client_or.ok()) return client_or.status();
  Client& client = **client_or;
  if (const std::string name = absl::GetFlag(FLAGS_destroy); !name.empty()) {
    if (absl::Status s = client.DestroyGroup(name); !s.ok()) return s;
    std::cout << "destroyed collective group '" << name << "'\n";
  }
  if (const std::string name = absl::GetFlag(FLAGS_release); !name.empty()) {
    if (absl::Status s = client.ReleaseGroup(name); !s.ok()) return s;
    std::cout << "released optimizer group '" << name << "'\n";
  }
  absl::StatusOr<std::vector<CollectiveGroupInfo>> collective = client.ListGroups();
  if (!collective.ok()) return collective.status();
  absl::StatusOr<OptimizerGroupList> optimizer = client.ListOptimizerGroups();
  if (!optimizer.ok()) return optimizer.status();
  std::cout << absl::StrFormat("%-24s %5s %5s %-7s %-7s %8s  %s\n", "COLLECTIVE GROUP", "RANK",
                               "WORLD", "BACKEND", "STATE", "NEXT_SEQ", "ERROR");
  for (const CollectiveGroupInfo& g : *collective) {
    std::cout << absl::StrFormat("%-24s %5d %5d %-7s %-7s %8d  %s\n", g.name, g.rank, g.world_size,
                                 CommBackendName(g.backend), GroupStateName(g.state),
                                 g.next_sequence, g.error);
  }
  std::cout << collective->size() << " collective group(s)\n";
  std::cout << absl::StrFormat("%-24s %8s %8s %6s %12s %14s %9s  %s\n", "OPTIMIZER GROUP", "STEP",
                               "UPDATES", "PARAMS", "ELEMENTS", "STATE_BYTES", "LAST_CKPT",
                               "ERROR");
  for (const OptimizerGroupInfo& g : optimizer->groups) {
    std::cout << absl::StrFormat(
        "%-24s %8d %8d %6d %12d %14d %9s  %s\n", g.name, g.step, g.update_count, g.num_parameters,
        g.num_elements, g.state_bytes,
        g.last_checkpoint_step < 0 ? std::string("-") : absl::StrCat(g.last_checkpoint_step),
        g.error);
  }
  std::cout << absl::StrFormat("%d optimizer group(s); %d of %d bytes of optimizer memory used\n",
                               optimizer->groups.size(), optimizer->memory_used_bytes,
                               optimizer->memory_limit_bytes);
  return absl::OkStatus();
}

}  // namespace
}  // namespace qtx::cli

int main(int argc, char** argv) {
  // --help lists this file's flags (Abseil's default keeps only flags of a
  // file named like the program, qtx.cc).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "client/cli/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "qtx <health|quantize|regions|allgather|step|groups> [flags]\n"
      "  qtx health [--wait=60s]            ask qtxd whether it is serving (--wait: until it is)\n"
      "  qtx quantize --shape=256x1024      quantize a random N(0,1) tensor\n"
      "  qtx quantize --npy=x.npy --mode=2d quantize a '<f4'/'<f2' .npy array\n"
      "  qtx regions                        list registered memory regions\n"
      "  qtx allgather --group=tp --rank=R --world_size=W [--coordinator=unix:/rank0.sock]\n"
      "                --shape=100x256      all-gather this rank's shard (run on every rank)\n"
      "  qtx step --group=g --steps=3       AdamW steps on an offloaded group (made if absent)\n"
      "  qtx groups [--destroy=G] [--release=G]  list (or remove) collective/optimizer groups\n"
      "Use --help for every flag of qtx.");
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
  } else if (command == "allgather") {
    status = qtx::cli::RunAllGather();
  } else if (command == "step") {
    status = qtx::cli::RunStep();
  } else if (command == "groups") {
    status = qtx::cli::RunGroups();
  } else {
    std::cerr << "qtx: unknown command '" << command << "'\n"
              << absl::ProgramUsageMessage() << "\n";
    return 2;
  }
  return qtx::cli::PrintStatus(status).ok() ? 0 : 1;
}

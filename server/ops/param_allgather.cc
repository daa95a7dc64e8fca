#include "server/ops/param_allgather.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/block_geometry.h"
#include "server/ops/optimizer.h"
#include "server/ops/output_placement.h"
#include "server/tensor/dtype.h"
#include "server/tensor/region_table.h"

namespace qtx::server::ops {
namespace {

using tensor::DType;
using tensor::MemoryKind;

// "qtxPARAG": marks a header of this op, so that a rank that made another
// collective call with the same sequence number is named, not misread.
constexpr uint64_t kMagic = 0x7174785041524147ull;
constexpr size_t kMaxDims = 8;  // dims carried for messages (all are digested)
constexpr size_t kMessageBytes = 256;

// What every rank sends before any data moves (fixed size, zero-filled).
struct ParamHeader {
  uint64_t magic;
  uint64_t sequence;
  int32_t code;  // this rank's verdict on its own request
  int32_t ndims;
  int64_t dims[kMaxDims];
  uint64_t shape_digest;
  int32_t scaling;
  int32_t format;
  int32_t pow2;
  uint32_t epsilon_bits;
  uint64_t scale_digest;
  int64_t begin;
  int64_t end;
  char message[kMessageBytes];
};
static_assert(std::is_trivially_copyable_v<ParamHeader>);

class Fnv1a {
 public:
  void Add(const void* data, size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) {
      h_ ^= p[i];
      h_ *= 0x100000001b3ull;
    }
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

std::string DimsString(const ParamHeader& h) {
  std::vector<int64_t> d(h.dims, h.dims + std::min<int64_t>(h.ndims, kMaxDims));
  return absl::StrCat("[", absl::StrJoin(d, ", "),
                      h.ndims > static_cast<int32_t>(kMaxDims) ? ", ...]" : "]");
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// This rank's request, resolved (step 1).
struct Local {
  Matrix2D mn;
  int64_t total = 0;
  kernels::QuantizedLayout layout;
  tensor::TensorView data;
  tensor::TensorView scale;
  std::optional<PlacedOutput> out_data;
  std::optional<PlacedOutput> out_scale;
  bool in_place = false;  // data already lies at its place in the output
  backend::DeviceBuffer data_staging, scale_staging;
  const uint8_t* data_ptr = nullptr;  // device-readable
  const void* scale_ptr = nullptr;    // device-readable
  uint64_t scale_digest = 0;
};

absl::Status ValidateLocally(const ParamAllGatherRequestSpec& r, const OpContext& ctx,
                             backend::Communicator& comm, Local& l) {
  QTX_RETURN_IF_ERROR(r.request_error);
  const kernels::QuantizeParams& p = r.params;
  if (p.scaling != kernels::BlockScaling::kBlock2D) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard.config.scaling_mode=%s: must be BLOCK_2D (the parameter all-gather moves shards "
        "of 128x128-block FP8 parameters; gather 1x128 activations with AllGather)",
        ScalingName(p.scaling)));
  }
  if (p.format != kernels::Fp8Format::kE4M3 && p.format != kernels::Fp8Format::kE5M2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard.config.format=%d: must be E4M3 or E5M2", static_cast<int>(p.format)));
  }
  constexpr const char* kRowwiseOnly =
      "only the rowwise copy is gathered: the columnwise copy of 128x128 blocks is its byte "
      "transpose with the transposed scales (make it from the result, docs/numerics.md §4.5)";
  if (r.has_columnwise_data) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard.columnwise_data: must be unset; %s", kRowwiseOnly));
  }
  if (r.outputs.columnwise_data.has_value() || r.outputs.columnwise_scale_inv.has_value()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "outputs.%s: must be unset; %s",
        r.outputs.columnwise_data.has_value() ? "columnwise_data" : "columnwise_scale_inv",
        kRowwiseOnly));
  }
  QTX_RETURN_IF_ERROR(ValidateCudaEvents(r.events, ctx));
  if (comm.memory_kind() != ctx.device->memory_kind()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "communicator %s cannot move the memory of device %s", comm.name(), ctx.device->name()));
  }
  QTX_ASSIGN_OR_RETURN(l.total, tensor::ValidateShape(r.shape, "shard.shape", ctx.limits));
  QTX_ASSIGN_OR_RETURN(l.mn, FlattenTo2D(r.shape, "shard.shape", ctx.limits));
  if (r.range.begin < 0 || r.range.begin > r.range.end || r.range.end > l.total) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "range=[%d, %d): must satisfy 0 <= begin <= end <= %d (the elements of shard.shape %s)",
        r.range.begin, r.range.end, l.total, ShapeText(r.shape)));
  }
  l.layout = kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, l.mn.m, l.mn.n);
  const std::string layout_desc = absl::StrFormat("BLOCK_2D layout of M=%d, N=%d", l.mn.m, l.mn.n);

  // The shard's data: end - begin FP8 bytes.
  const DType data_dtype = tensor::Fp8DataDType(p.format);
  if (!r.data.has_value()) return absl::InvalidArgumentError("shard.rowwise_data: missing");
  if (r.data->dtype != data_dtype && r.data->dtype != DType::kUInt8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard.rowwise_data.dtype=%s: must be %s or UINT8 for format %s",
        tensor::DTypeName(r.data->dtype), tensor::DTypeName(data_dtype), FormatName(p.format)));
  }
  QTX_ASSIGN_OR_RETURN(
      l.data, tensor::ResolveInput(*r.data, "shard.rowwise_data", *ctx.regions, ctx.limits));
  if (l.data.elements != r.range.count()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard.rowwise_data.shape=%s: %d elements, expected end - begin = %d "
        "(range [%d, %d))",
        ShapeText(l.data.shape), l.data.elements, r.range.count(), r.range.begin, r.range.end));
  }
  // The whole parameter's scales.
  if (!r.scale_inv.has_value()) {
    return absl::InvalidArgumentError("shard.rowwise_scale_inv: missing");
  }
  if (r.scale_inv->dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard.rowwise_scale_inv.dtype=%s: must be FLOAT32",
                        tensor::DTypeName(r.scale_inv->dtype)));
  }
  QTX_ASSIGN_OR_RETURN(l.scale, tensor::ResolveInput(*r.scale_inv, "shard.rowwise_scale_inv",
                                                     *ctx.regions, ctx.limits));
  if (l.scale.shape.size() != 2 || l.scale.shape[0] != l.layout.rowwise_scale_rows ||
      l.scale.shape[1] != l.layout.rowwise_scale_cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard.rowwise_scale_inv.shape=%s: expected [%d, %d], the whole parameter's scales (%s)",
        ShapeText(l.scale.shape), l.layout.rowwise_scale_rows, l.layout.rowwise_scale_cols,
        layout_desc));
  }

  // Outputs: the whole rowwise copy.
  QTX_RETURN_IF_ERROR(PlaceOutput(r.outputs.rowwise_data, static_cast<uint64_t>(l.total), 1,
                                  data_dtype, {l.mn.m, l.mn.n}, "outputs.rowwise_data", ctx,
                                  l.out_data));
  const uint64_t scale_bytes = static_cast<uint64_t>(l.layout.RowwiseScaleCount()) * 4;
  QTX_RETURN_IF_ERROR(
      PlaceOutput(r.outputs.rowwise_scale_inv, scale_bytes, 4, DType::kFloat32,
                  ScaleShape(kernels::BlockScaling::kBlock2D, l.layout.rowwise_scale_rows,
                             l.layout.rowwise_scale_cols),
                  "outputs.rowwise_scale_inv", ctx, l.out_scale));
  // A shard that already lies at its place in the output region is gathered
  // in place; the same holds for a scale tensor that is the output's.
  const PlacedOutput& od = *l.out_data;
  l.in_place = l.data.pin != nullptr && l.data.byte_size > 0 && od.slice.has_value() &&
               od.staging.data() == nullptr && l.data.memory == od.slice->memory &&
               l.data.data == static_cast<const std::byte*>(od.slice->data) + r.range.begin;
  const PlacedOutput& os = *l.out_scale;
  const bool scale_is_output = l.scale.pin != nullptr && os.slice.has_value() &&
                               l.scale.data == os.slice->data && l.scale.byte_size == scale_bytes;
  std::vector<NamedRange> ranges;
  uint64_t inline_bytes = 0;
  if (l.data.pin != nullptr && !l.in_place) {
    ranges.push_back({"shard.rowwise_data", l.data.data, l.data.byte_size});
  }
  if (l.scale.pin != nullptr && !scale_is_output) {
    ranges.push_back({"shard.rowwise_scale_inv", l.scale.data, l.scale.byte_size});
  }
  for (const auto* o : {&l.out_data, &l.out_scale}) {
    if ((*o)->slice.has_value()) {
      ranges.push_back({o == &l.out_data ? "outputs.rowwise_data" : "outputs.rowwise_scale_inv",
                        (*o)->slice->data, (*o)->bytes});
    } else {
      inline_bytes += (*o)->bytes;
    }
  }
  QTX_RETURN_IF_ERROR(CheckNoOverlap(ranges));
  QTX_RETURN_IF_ERROR(CheckInlineBudget(inline_bytes, ctx, "AllGatherParameter"));

  // Everything below reads the shard: after the client's GPU work.
  if (!r.events.empty()) {
    QTX_RETURN_IF_ERROR(ctx.device->OrderAfterClient(r.events));
    QTX_RETURN_IF_ERROR(ctx.device->SynchronizeThisThread());
  }
  Fnv1a digest;
  if (l.scale.memory == MemoryKind::kHost) {
    digest.Add(l.scale.data, l.scale.byte_size);
  } else {
    std::vector<std::byte> host(l.scale.byte_size);
    QTX_RETURN_IF_ERROR(ctx.device->CopyToHost(host.data(), l.scale.data, host.size()));
    digest.Add(host.data(), host.size());
  }
  l.scale_digest = digest.value();
  QTX_ASSIGN_OR_RETURN(const void* data_ptr,
                       InputOnDevice(l.data, "shard.rowwise_data", ctx, l.data_staging));
  l.data_ptr = static_cast<const uint8_t*>(data_ptr);
  if (scale_is_output) {
    l.scale_ptr = nullptr;  // nothing to copy
  } else {
    QTX_ASSIGN_OR_RETURN(l.scale_ptr,
                         InputOnDevice(l.scale, "shard.rowwise_scale_inv", ctx, l.scale_staging));
  }
  return absl::OkStatus();
}

ParamHeader MakeHeader(const ParamAllGatherRequestSpec& r, const Local& l,
                       const absl::Status& local) {
  ParamHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kMagic;
  h.sequence = r.sequence;
  h.code = static_cast<int32_t>(local.code());
  if (!local.ok()) {
    const std::string_view msg(local.message().data(), local.message().size());
    std::memcpy(h.message, msg.data(), std::min(msg.size(), kMessageBytes - 1));
  }
  h.ndims = static_cast<int32_t>(r.shape.size());
  Fnv1a shape;
  for (size_t i = 0; i < r.shape.size(); ++i) {
    if (i < kMaxDims) h.dims[i] = r.shape[i];
    shape.Add(&r.shape[i], sizeof(int64_t));
  }
  h.shape_digest = shape.value();
  h.scaling = static_cast<int32_t>(r.params.scaling);
  h.format = static_cast<int32_t>(r.params.format);
  h.pow2 = r.params.force_pow2_scales ? 1 : 0;
  std::memcpy(&h.epsilon_bits, &r.params.amax_epsilon, 4);
  h.scale_digest = l.scale_digest;
  h.begin = r.range.begin;
  h.end = r.range.end;
  return h;
}

// The first field in which a rank differs from rank 0, "" if none.
std::string Disagreement(const std::vector<ParamHeader>& h) {
  auto eps = [](uint32_t bits) {
    float e;
    std::memcpy(&e, &bits, 4);
    return absl::StrFormat("%g", e);
  };
  auto flag = [](int32_t v) { return std::string(v != 0 ? "true" : "false"); };
  struct Field {
    const char* name;
    std::function<bool(const ParamHeader&, const ParamHeader&)> differs;
    std::function<std::string(const ParamHeader&)> show;
  };
  const Field fields[] = {
      {"sequence", [](const auto& a, const auto& b) { return a.sequence != b.sequence; },
       [](const auto& x) { return absl::StrCat(x.sequence); }},
      {"shard.shape",
       [](const auto& a, const auto& b) {
         return a.ndims != b.ndims || a.shape_digest != b.shape_digest;
       },
       [](const auto& x) { return DimsString(x); }},
      {"shard.config.scaling_mode",
       [](const auto& a, const auto& b) { return a.scaling != b.scaling; },
       [](const auto& x) {
         return std::string(ScalingName(static_cast<kernels::BlockScaling>(x.scaling)));
       }},
      {"shard.config.format", [](const auto& a, const auto& b) { return a.format != b.format; },
       [](const auto& x) {
         return std::string(FormatName(static_cast<kernels::Fp8Format>(x.format)));
       }},
      {"shard.config.force_pow2_scales",
       [](const auto& a, const auto& b) { return a.pow2 != b.pow2; },
       [&](const auto& x) { return flag(x.pow2); }},
      {"shard.config.amax_epsilon",
       [](const auto& a, const auto& b) { return a.epsilon_bits != b.epsilon_bits; },
       [&](const auto& x) { return eps(x.epsilon_bits); }},
      {"shard.rowwise_scale_inv",
       [](const auto& a, const auto& b) { return a.scale_digest != b.scale_digest; },
       [](const auto& x) { return absl::StrFormat("scales with digest %016x", x.scale_digest); }},
  };
  for (const Field& f : fields) {
    for (size_t r = 1; r < h.size(); ++r) {
      if (f.differs(h[0], h[r])) {
        std::string s = absl::StrFormat("ranks disagree on %s: rank 0 has %s, rank %d has %s",
                                        f.name, f.show(h[0]), r, f.show(h[r]));
        if (std::string_view(f.name) == "shard.rowwise_scale_inv") {
          absl::StrAppend(&s,
                          " (every rank must pass the whole parameter's scales, the same bytes: "
                          "the shards come from different quantizations)");
        }
        return s;
      }
    }
  }
  return "";
}

}  // namespace

uint64_t ScaleDigest(std::span<const std::byte> bytes) {
  Fnv1a f;
  f.Add(bytes.data(), bytes.size());
  return f.value();
}

absl::StatusOr<ParamAllGatherResult> AllGatherParameter(const ParamAllGatherRequestSpec& request,
                                                        const OpContext& ctx,
                                                        backend::Communicator& comm,
                                                        const backend::CommCall& call,
                                                        bool* group_broken) {
  const std::string prefix = absl::StrFormat(
      "AllGatherParameter(group '%s', sequence %d%s): ", request.group, request.sequence,
      request.name.empty() ? std::string() : absl::StrCat(", parameter '", request.name, "'"));
  auto comm_failed = [&](const absl::Status& s) {
    if (s.code() != absl::StatusCode::kInvalidArgument) {
      *group_broken = true;
      return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
    }
    // Sizes that differ: another kind of collective call at this sequence.
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, s.message(), " (every rank must call AllGatherParameter with this sequence)"));
  };
  const int world = comm.world_size();

  // Step 1: this rank's request (a failure is announced in step 2).
  Local l;
  const absl::Status local = ValidateLocally(request, ctx, comm, l);

  // Step 2: the headers.
  const ParamHeader mine = MakeHeader(request, l, local);
  std::vector<ParamHeader> h(static_cast<size_t>(world));
  if (absl::Status s = comm.AllGatherHost(&mine, sizeof(mine), h.data(), call); !s.ok()) {
    return comm_failed(s);
  }

  // Step 3: the verdict, the same on every rank.
  for (int r = 0; r < world; ++r) {
    if (h[r].magic != kMagic) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%srank %d made another collective call with this sequence number (every rank must "
          "call AllGatherParameter)",
          prefix, r));
    }
  }
  if (!local.ok()) return absl::Status(local.code(), absl::StrCat(prefix, local.message()));
  for (int r = 0; r < world; ++r) {
    if (h[r].code != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(h[r].code),
          absl::StrFormat("%srank %d's request failed: %s", prefix, r,
                          std::string(h[r].message, strnlen(h[r].message, kMessageBytes))));
    }
  }
  if (std::string d = Disagreement(h); !d.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, d));
  }
  ParamAllGatherResult out;
  std::vector<std::vector<kernels::ElementRange>> per_rank(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    out.ranges.push_back({h[r].begin, h[r].end});
    per_rank[r] = {out.ranges.back()};
  }
  if (absl::Status s = CheckShardPartition({request.name.empty() ? "(unnamed)" : request.name},
                                           {l.total}, per_rank);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, s.message()));
  }

  // Step 4: the data bytes, then the scales.
  std::vector<uint64_t> sizes(static_cast<size_t>(world));
  std::vector<int64_t> offsets(static_cast<size_t>(world));
  int64_t offset = 0;
  out.direct = true;
  for (int r = 0; r < world; ++r) {
    sizes[r] = static_cast<uint64_t>(out.ranges[r].count());
    offsets[r] = offset;
    if (!out.ranges[r].empty() && out.ranges[r].begin != offset) out.direct = false;
    offset += out.ranges[r].count();
  }
  AllocateInline(l.out_data);
  AllocateInline(l.out_scale);
  auto* dst = static_cast<uint8_t*>(l.out_data->KernelPointer());
  if (l.total > 0) {
    if (out.direct) {
      out.in_place = l.in_place;
      const void* send = l.in_place ? dst + request.range.begin : l.data_ptr;
      if (absl::Status s = comm.AllGatherV(send, sizes, dst, call); !s.ok()) return comm_failed(s);
    } else {
      // Ranges out of rank order: gather in rank order, then move each
      // rank's bytes to their offset.
      QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer tmp,
                           ctx.device->Allocate(static_cast<uint64_t>(l.total)));
      auto* gathered = static_cast<uint8_t*>(tmp.data());
      if (absl::Status s = comm.AllGatherV(l.data_ptr, sizes, gathered, call); !s.ok()) {
        return comm_failed(s);
      }
      for (int r = 0; r < world; ++r) {
        if (sizes[r] == 0) continue;
        QTX_RETURN_IF_ERROR(
            ctx.device->CopyOnDevice(dst + out.ranges[r].begin, gathered + offsets[r], sizes[r]));
      }
      QTX_RETURN_IF_ERROR(ctx.device->SynchronizeThisThread());
    }
  }
  if (l.scale_ptr != nullptr && l.out_scale->bytes > 0) {
    QTX_RETURN_IF_ERROR(
        ctx.device->CopyOnDevice(l.out_scale->KernelPointer(), l.scale_ptr, l.out_scale->bytes));
  }
  QTX_RETURN_IF_ERROR(ctx.device->SynchronizeThisThread());
  QTX_RETURN_IF_ERROR(CopyBack(l.out_data, *ctx.device));
  QTX_RETURN_IF_ERROR(CopyBack(l.out_scale, *ctx.device));
  QTX_RETURN_IF_ERROR(tensor::CheckIntact(l.data.pin));
  QTX_RETURN_IF_ERROR(tensor::CheckIntact(l.scale.pin));
  for (const auto* o : {&l.out_data, &l.out_scale}) {
    if ((*o)->slice.has_value()) QTX_RETURN_IF_ERROR(tensor::CheckIntact((*o)->slice->pin));
  }
  QTX_RETURN_IF_ERROR(ctx.device->SignalClient(request.events));

  out.result.shape = request.shape;
  out.result.source_dtype = DType::kFloat32;
  out.result.params = request.params;
  out.result.params.rowwise = true;
  out.result.params.columnwise = false;
  out.result.rowwise_data = std::move(l.out_data->tensor);
  out.result.rowwise_scale_inv = std::move(l.out_scale->tensor);
  return out;
}

}  // namespace qtx::server::ops

#include "server/ops/allgather.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/block_geometry.h"
#include "kernels/one_round_plan.h"
#include "kernels/shard_geometry.h"
#include "server/ops/output_placement.h"

namespace qtx::server::ops {
namespace {

using tensor::DType;
using tensor::MemoryKind;

constexpr uint32_t kMagic = 0x31585451;  // "QTX1"
constexpr size_t kMessageBytes = 192;

// What every rank tells the others before data moves (step 2), and the status
// of step 3. Plain bytes: the ranks run the same build on the same machine
// type.
struct WireStatus {
  int32_t code = 0;  // absl::StatusCode; 0 = OK
  char message[kMessageBytes] = {};
};

struct WireHeader {
  uint32_t magic = kMagic;
  int32_t dtype = 0;
  uint64_t sequence = 0;
  int64_t n = 0;
  int64_t m = 0;
  int32_t mode = 0;
  int32_t scaling = 0;
  int32_t format = 0;
  int32_t rowwise = 0;
  int32_t columnwise = 0;
  int32_t pow2 = 0;
  uint32_t epsilon_bits = 0;
  // 1 when this rank resolved its outputs before the exchange (PrepareEarly):
  // when every rank did, nothing is left that can fail on one rank only, and
  // the status exchange of step 3 is skipped.
  int32_t early = 0;
  uint64_t out_size[4] = {};  // the output slices' sizes (early only)
  WireStatus status;
  WireStatus prepared;  // early: the outcome of PrepareEarly
};

WireStatus ToWire(const absl::Status& s) {
  WireStatus w;
  w.code = static_cast<int32_t>(s.code());
  const std::string_view msg(s.message().data(), s.message().size());
  // An OK status has an empty message whose data() may be null: memcpy from
  // null is undefined even for 0 bytes (UBSan, found by fuzz_collective).
  if (!msg.empty()) std::memcpy(w.message, msg.data(), std::min(msg.size(), kMessageBytes - 1));
  return w;
}

absl::Status FromWire(const WireStatus& w, const std::string& prefix) {
  return absl::Status(static_cast<absl::StatusCode>(w.code),
                      prefix + std::string(w.message, strnlen(w.message, kMessageBytes)));
}

// All-gathers `bytes` host bytes per rank (a device communicator moves them
// through its own reusable buffers: one launch, one wait).
absl::Status ExchangeFixed(const void* send, uint64_t bytes, void* recv,
                           backend::Communicator& comm, const backend::CommCall& call,
                           const std::function<void()>& in_flight = nullptr) {
  return comm.AllGatherHost(send, bytes, recv, call, in_flight);
}

// The first field in which rank r's header differs from rank 0's.
absl::Status CheckAgreement(const std::vector<WireHeader>& h, const std::string& prefix) {
  auto describe = [](const char* name, const WireHeader& x) -> std::string {
    const std::string_view f = name;
    if (f == "sequence") return absl::StrCat(x.sequence);
    if (f == "n") return absl::StrCat(x.n);
    if (f == "dtype") return std::string(tensor::DTypeName(static_cast<DType>(x.dtype)));
    if (f == "mode") return std::string(AllGatherModeName(static_cast<AllGatherMode>(x.mode)));
    if (f == "config.scaling_mode")
      return std::string(ScalingName(static_cast<kernels::BlockScaling>(x.scaling)));
    if (f == "config.format")
      return std::string(FormatName(static_cast<kernels::Fp8Format>(x.format)));
    if (f == "config.rowwise") return x.rowwise ? "true" : "false";
    if (f == "config.columnwise") return x.columnwise ? "true" : "false";
    if (f == "config.force_pow2_scales") return x.pow2 ? "true" : "false";
    float e;
    std::memcpy(&e, &x.epsilon_bits, 4);
    return absl::StrFormat("%g", e);
  };
  auto differs = [](const char* name, const WireHeader& a, const WireHeader& b) {
    const std::string_view f = name;
    if (f == "sequence") return a.sequence != b.sequence;
    if (f == "n") return a.n != b.n;
    if (f == "dtype") return a.dtype != b.dtype;
    if (f == "mode") return a.mode != b.mode;
    if (f == "config.scaling_mode") return a.scaling != b.scaling;
    if (f == "config.format") return a.format != b.format;
    if (f == "config.rowwise") return a.rowwise != b.rowwise;
    if (f == "config.columnwise") return a.columnwise != b.columnwise;
    if (f == "config.force_pow2_scales") return a.pow2 != b.pow2;
    return a.epsilon_bits != b.epsilon_bits;
  };
  static constexpr const char* kFields[] = {"sequence",
                                            "n",
                                            "dtype",
                                            "mode",
                                            "config.scaling_mode",
                                            "config.format",
                                            "config.rowwise",
                                            "config.columnwise",
                                            "config.force_pow2_scales",
                                            "config.amax_epsilon"};
  for (const char* f : kFields) {
    for (size_t r = 1; r < h.size(); ++r) {
      if (differs(f, h[0], h[r])) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%sranks disagree on %s: rank 0 has %s, rank %d has %s", prefix, f,
                            describe(f, h[0]), r, describe(f, h[r])));
      }
    }
  }
  return absl::OkStatus();
}

// Byte layout of one rank's packed shard (kernels/shard_geometry.h shard
// layout, each section rounded up to 16 bytes so that scales stay aligned).
// The rowwise data is not packed: it is quantized straight into its place in
// the output and gathered there in place (the bulk of the bytes never takes
// an extra copy).
struct PackedShard {
  uint64_t rw_scale = 0, cw_data = 0, cw_scale = 0, total = 0;
};
uint64_t Round16(uint64_t x) { return (x + 15) / 16 * 16; }
PackedShard PackShard(const kernels::ShardGeometry& g, const kernels::QuantizeParams& p) {
  PackedShard s;
  uint64_t off = 0;
  const uint64_t data = static_cast<uint64_t>(g.m * g.n);
  if (p.rowwise) {
    s.rw_scale = off;
    off += Round16(4 * static_cast<uint64_t>(kernels::ShardRowwiseScaleCount(p.scaling, g)));
  }
  if (p.columnwise) {
    s.cw_data = off;
    off += Round16(data);
    s.cw_scale = off;
    off += Round16(4 * static_cast<uint64_t>(kernels::ShardColumnwiseScaleCount(p.scaling, g)));
  }
  s.total = off;
  return s;
}

// A channel (stream-ordered) AllGather's tensors must be in the memory the
// device computes on: staging through the host would make the host wait.
std::string ChannelMemoryMessage(std::string_view field, const OpContext& ctx) {
  const bool device = ctx.device->memory_kind() == MemoryKind::kDevice;
  return absl::StrFormat(
      "%s: a channel AllGather on %s needs its tensors in %s memory (register a %s region)", field,
      ctx.device->name(), device ? "device" : "host", device ? "cuda_ipc" : "shm");
}

struct LocalRequest {
  tensor::TensorView input;
  Matrix2D mn;
  kernels::InputDType dtype = kernels::InputDType::kFloat32;
};

absl::StatusOr<LocalRequest> ValidateLocal(const AllGatherRequestSpec& r, const OpContext& ctx,
                                           backend::Communicator& comm) {
  QTX_RETURN_IF_ERROR(r.request_error);
  QTX_RETURN_IF_ERROR(ValidateQuantizeParams(r.params, "config"));
  QTX_RETURN_IF_ERROR(ValidateCudaEvents(r.events, ctx));
  if (r.mode != AllGatherMode::kExactFp8 && r.mode != AllGatherMode::kGatherHighPrecision) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "mode=%d: must be EXACT_FP8 or GATHER_HIGH_PRECISION", static_cast<int>(r.mode)));
  }
  const auto dtype = tensor::ToInputDType(r.input.dtype);
  if (!dtype.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("input.dtype=%s: AllGather accepts FLOAT32, BFLOAT16 or FLOAT16",
                        tensor::DTypeName(r.input.dtype)));
  }
  const struct {
    const std::optional<tensor::RegionSliceSpec>& spec;
    bool requested;
    const char* field;
  } checks[] = {
      {r.outputs.rowwise_data, r.params.rowwise, "outputs.rowwise_data"},
      {r.outputs.rowwise_scale_inv, r.params.rowwise, "outputs.rowwise_scale_inv"},
      {r.outputs.columnwise_data, r.params.columnwise, "outputs.columnwise_data"},
      {r.outputs.columnwise_scale_inv, r.params.columnwise, "outputs.columnwise_scale_inv"}};
  for (const auto& c : checks) {
    if (c.spec.has_value() && !c.requested) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s is set but that copy is not requested in config", c.field));
    }
  }
  if (comm.memory_kind() != ctx.device->memory_kind()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "communicator %s cannot move the memory of device %s", comm.name(), ctx.device->name()));
  }
  LocalRequest l;
  l.dtype = *dtype;
  QTX_ASSIGN_OR_RETURN(l.input, tensor::ResolveInput(r.input, "input", *ctx.regions, ctx.limits));
  QTX_ASSIGN_OR_RETURN(l.mn, FlattenTo2D(l.input.shape, "input", ctx.limits));
  if (r.events.queue != nullptr && l.input.byte_size > 0 &&
      l.input.memory != ctx.device->memory_kind()) {
    // A channel op only enqueues: nothing may need a host copy.
    return absl::FailedPreconditionError(ChannelMemoryMessage("input", ctx));
  }
  return l;
}

// The input (a region slice) and the region outputs, for CheckNoOverlap.
std::vector<NamedRange> OutputRanges(const tensor::TensorView& input,
                                     const std::array<std::optional<PlacedOutput>, 4>& outs) {
  std::vector<NamedRange> ranges;
  if (input.pin != nullptr) ranges.push_back({"input", input.data, input.byte_size});
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i] && outs[i]->slice) {
      ranges.push_back({kQuantizedOutputFields[i], outs[i]->slice->data, outs[i]->bytes});
    }
  }
  return ranges;
}

// Step 1b, the early path. When every output is a region slice in memory
// the device computes on and the input is there too (no staging), the only
// step-3 checks left that depend on the peers are the slice sizes, which
// every rank can check for every rank once the sizes travel in the header.
// So the slices are resolved now (at their stated sizes: region, bounds,
// alignment, memory kind, overlaps) and the outcome travels in the header.
// Returns false when the request does not qualify (nothing resolved), an
// error when it qualifies but a slice is bad.
absl::StatusOr<bool> PrepareEarly(const AllGatherRequestSpec& r, const LocalRequest& l,
                                  const OpContext& ctx,
                                  std::array<std::optional<PlacedOutput>, 4>& outs) {
  const kernels::QuantizeParams& p = r.params;
  for (int i = 0; i < 4; ++i) {
    if (OutputRequested(p, i) && !OutputSpec(r.outputs, i).has_value()) return false;  // inline
  }
  if (l.input.byte_size > 0 && l.input.memory != ctx.device->memory_kind()) return false;
  for (int i = 0; i < 4; ++i) {
    if (!OutputRequested(p, i)) continue;
    const tensor::RegionSliceSpec& spec = *OutputSpec(r.outputs, i);
    outs[i].emplace();
    outs[i]->bytes = spec.size;
    outs[i]->tensor.region = spec;
    QTX_ASSIGN_OR_RETURN(outs[i]->slice,
                         tensor::ResolveOutputSlice(spec, spec.size, kQuantizedOutputAlignment[i],
                                                    kQuantizedOutputFields[i], *ctx.regions));
    if (spec.size > 0 && outs[i]->slice->memory != ctx.device->memory_kind()) {
      if (r.events.queue != nullptr) {
        return absl::FailedPreconditionError(ChannelMemoryMessage(kQuantizedOutputFields[i], ctx));
      }
      return false;
    }
  }
  QTX_RETURN_IF_ERROR(CheckNoOverlap(OutputRanges(l.input, outs)));
  return true;
}

// ---- One round (request.shard_rows set; allgather.h) ----

constexpr uint32_t kOneRoundMagic = 0x32585451;  // "QTX2"

// The start of every rank's slot. Plain bytes like WireHeader (same build,
// same machine type on every rank; the magic and header_bytes catch a peer
// that is not). The fields every rank must send identically come first, up
// to `rank` (kAgreedBytes): the slot check compares that prefix with this
// rank's own bytes (on the device: Device::CheckSlotHeaders), then `rank`
// and status.code. No padding anywhere (static_assert below), so equal
// values are equal bytes.
struct OneRoundHeader {
  uint32_t magic = kOneRoundMagic;
  uint32_t header_bytes = 0;  // sizeof(OneRoundHeader), set by MakeHeader
  uint64_t slot_bytes = 0;    // the slot size this rank computed
  uint64_t digest = 0;        // AgreementDigest of the fields below
  // What every rank must agree on, carried in full to name the field that
  // differs when the digests do.
  uint64_t sequence = 0;
  int64_t n = 0;
  int32_t dtype = 0;
  int32_t mode = 0;
  int32_t scaling = 0;
  int32_t format = 0;
  int32_t rowwise = 0;
  int32_t columnwise = 0;
  int32_t pow2 = 0;
  uint32_t epsilon_bits = 0;
  int32_t world = 0;
  uint32_t reserved0 = 0;
  uint64_t shard_rows_digest = 0;  // Fnv1a64 of the sender's shard_rows list
  // Per rank (not agreed).
  int32_t rank = 0;  // the sender (checked against its slot)
  uint32_t reserved1 = 0;
  int64_t local_rows = -1;  // rows of the sender's input (-1: unknown)
  WireStatus status;        // the sender's verdict on its own request (code first)
  uint32_t reserved2 = 0;
};
static_assert(std::has_unique_object_representations_v<OneRoundHeader>,
              "OneRoundHeader must have no padding: the slot check compares bytes");
static_assert(sizeof(OneRoundHeader) % 4 == 0);
constexpr uint32_t kAgreedBytes = offsetof(OneRoundHeader, rank);
constexpr uint32_t kStatusCodeOffset = offsetof(OneRoundHeader, status);

// The fields of either header (WireHeader, OneRoundHeader) that come from
// the request and that every rank must send identically: the sequence, the
// dtype, the mode and the quantize config `p`.
template <typename Header>
void SetRequestFields(const AllGatherRequestSpec& request, const kernels::QuantizeParams& p,
                      Header* h) {
  h->sequence = request.sequence;
  h->dtype = static_cast<int32_t>(request.input.dtype);
  h->mode = static_cast<int32_t>(request.mode);
  h->scaling = static_cast<int32_t>(p.scaling);
  h->format = static_cast<int32_t>(p.format);
  h->rowwise = p.rowwise;
  h->columnwise = p.columnwise;
  h->pow2 = p.force_pow2_scales;
  std::memcpy(&h->epsilon_bits, &p.amax_epsilon, 4);
}

// 64-bit FNV-1a: a fixed function (unlike absl::Hash, which is seeded per
// process), so every sidecar computes the same digest of the same fields.
class Fnv1a64 {
 public:
  template <typename T>
  Fnv1a64& Add(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    unsigned char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    for (unsigned char c : b) h_ = (h_ ^ c) * 0x100000001b3ULL;
    return *this;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

uint64_t ShardRowsDigest(std::span<const int64_t> rows) {
  Fnv1a64 f;
  f.Add(static_cast<uint64_t>(rows.size()));
  for (int64_t m : rows) f.Add(m);
  return f.value();
}

uint64_t AgreementDigest(const OneRoundHeader& h) {
  return Fnv1a64()
      .Add(h.sequence)
      .Add(h.n)
      .Add(h.dtype)
      .Add(h.mode)
      .Add(h.scaling)
      .Add(h.format)
      .Add(h.rowwise)
      .Add(h.columnwise)
      .Add(h.pow2)
      .Add(h.epsilon_bits)
      .Add(h.world)
      .Add(h.shard_rows_digest)
      .value();
}

// The quantized copies `p` requests, at byte offsets of `base` (a slot or
// scratch in the shard layout).
kernels::QuantizedBuffers BuffersAt(uint8_t* base, const kernels::QuantizeParams& p,
                                    uint64_t rw_data, uint64_t rw_scale, uint64_t cw_data,
                                    uint64_t cw_scale) {
  kernels::QuantizedBuffers b;
  if (p.rowwise) {
    b.rowwise_data = base + rw_data;
    b.rowwise_scale_inv = reinterpret_cast<float*>(base + rw_scale);
  }
  if (p.columnwise) {
    b.columnwise_data = base + cw_data;
    b.columnwise_scale_inv = reinterpret_cast<float*>(base + cw_scale);
  }
  return b;
}

// Byte offsets inside one rank's slot (each section 16-byte aligned).
struct SlotLayout {
  uint64_t rw_data = 0, rw_scale = 0, cw_data = 0, cw_scale = 0;  // interior (EXACT_FP8)
  uint64_t head = 0, tail = 0;  // straddling rows, input precision (EXACT_FP8)
  uint64_t rows = 0;            // the whole shard, input precision (GATHER_HIGH_PRECISION)
  uint64_t total = 0;
};

SlotLayout LayoutSlot(const kernels::OneRoundShard& s, int64_t n, int64_t esize,
                      const kernels::QuantizeParams& p, bool exact) {
  SlotLayout l;
  uint64_t off = Round16(sizeof(OneRoundHeader));
  const auto bytes = [&](int64_t rows) { return static_cast<uint64_t>(rows * n * esize); };
  if (!exact) {
    l.rows = off;
    off += Round16(bytes(s.m));
    l.total = off;
    return l;
  }
  const kernels::ShardGeometry& g = s.interior;
  if (p.rowwise) {
    l.rw_data = off;
    off += Round16(static_cast<uint64_t>(g.m * n));
    l.rw_scale = off;
    off += Round16(4 * static_cast<uint64_t>(kernels::ShardRowwiseScaleCount(p.scaling, g)));
  }
  if (p.columnwise) {
    l.cw_data = off;
    off += Round16(static_cast<uint64_t>(g.m * n));
    l.cw_scale = off;
    off += Round16(4 * static_cast<uint64_t>(kernels::ShardColumnwiseScaleCount(p.scaling, g)));
  }
  l.head = off;
  off += Round16(bytes(s.head_rows));
  l.tail = off;
  off += Round16(bytes(s.tail_rows));
  l.total = off;
  return l;
}

// The first agreed field in which header `b` differs from header `a`, as
// "name: rank X has A, rank Y has B"; empty when they agree.
std::string FirstDifference(const OneRoundHeader& a, int ra, const OneRoundHeader& b, int rb) {
  auto flag = [](int32_t v) { return v ? "true" : "false"; };
  auto eps = [](uint32_t bits) {
    float e;
    std::memcpy(&e, &bits, 4);
    return absl::StrFormat("%g", e);
  };
  auto say = [&](std::string_view field, const std::string& x, const std::string& y) {
    return absl::StrFormat("%s: rank %d has %s, rank %d has %s", field, ra, x, rb, y);
  };
  if (a.sequence != b.sequence)
    return say("sequence", absl::StrCat(a.sequence), absl::StrCat(b.sequence));
  if (a.world != b.world) return say("world_size", absl::StrCat(a.world), absl::StrCat(b.world));
  if (a.n != b.n) return say("n", absl::StrCat(a.n), absl::StrCat(b.n));
  if (a.dtype != b.dtype) {
    return say("dtype", std::string(tensor::DTypeName(static_cast<DType>(a.dtype))),
               std::string(tensor::DTypeName(static_cast<DType>(b.dtype))));
  }
  if (a.mode != b.mode) {
    return say("mode", std::string(AllGatherModeName(static_cast<AllGatherMode>(a.mode))),
               std::string(AllGatherModeName(static_cast<AllGatherMode>(b.mode))));
  }
  if (a.scaling != b.scaling) {
    return say("config.scaling_mode",
               std::string(ScalingName(static_cast<kernels::BlockScaling>(a.scaling))),
               std::string(ScalingName(static_cast<kernels::BlockScaling>(b.scaling))));
  }
  if (a.format != b.format) {
    return say("config.format", std::string(FormatName(static_cast<kernels::Fp8Format>(a.format))),
               std::string(FormatName(static_cast<kernels::Fp8Format>(b.format))));
  }
  if (a.rowwise != b.rowwise) return say("config.rowwise", flag(a.rowwise), flag(b.rowwise));
  if (a.columnwise != b.columnwise)
    return say("config.columnwise", flag(a.columnwise), flag(b.columnwise));
  if (a.pow2 != b.pow2) return say("config.force_pow2_scales", flag(a.pow2), flag(b.pow2));
  if (a.epsilon_bits != b.epsilon_bits)
    return say("config.amax_epsilon", eps(a.epsilon_bits), eps(b.epsilon_bits));
  if (a.shard_rows_digest != b.shard_rows_digest) {
    return absl::StrFormat("shard_rows: rank %d and rank %d passed different lists", ra, rb);
  }
  return "";
}

// One AllGather call on this rank: the protocol steps of allgather.h, one
// member function each, and the state they hand on to the next step. Used
// once, by one thread (the group's executor).
struct AllGatherCall {
  AllGatherCall(const AllGatherRequestSpec& request, const OpContext& ctx,
                backend::Communicator& comm, const backend::CommCall& call, bool* group_broken)
      : request(request),
        ctx(ctx),
        comm(comm),
        call(call),
        group_broken(group_broken),
        world(comm.world_size()),
        rank(comm.rank()),
        prefix(absl::StrFormat("AllGather(group '%s', sequence %d): ", request.group,
                               request.sequence)),
        p(request.params),
        exact(request.mode == AllGatherMode::kExactFp8) {}

  // The steps, in order; each returns what fails this rank's call.
  absl::StatusOr<AllGatherResult> Run();
  // Step 1: local validation and the early path (a failure is still
  // announced to the peers in step 2, so it is kept in `local`).
  void ValidateLocally();
  // Step 2: the header exchange and the agreement check.
  absl::Status ExchangeHeaders();
  // Step 3: geometry, then the outputs (EarlyVerdict when every rank
  // resolved them in step 1, else PlaceOutputs) and the status exchange.
  absl::Status PrepareOutputs();
  absl::Status EarlyVerdict();
  absl::Status PlaceOutputs();
  // Step 4: the data plane, EXACT_FP8 or GATHER_HIGH_PRECISION.
  absl::Status GatherExact(const backend::CommCall& data_call, bool stream_ordered);
  absl::Status GatherHighPrecision(const backend::CommCall& data_call, bool stream_ordered);
  // Copies staged outputs back, signals the client, builds the result.
  absl::StatusOr<AllGatherResult> Finish();

  // The one-round path (request.shard_rows set), in place of steps 1-4.
  absl::StatusOr<AllGatherResult> RunOneRound();
  // Checks shard_rows against the group and this rank's input.
  // Sets *usable when the list describes a tensor within the limits (even
  // if it contradicts this rank's input).
  absl::Status CheckShardRows(bool* usable) const;
  // GATHER_HIGH_PRECISION's last step, shared by both paths: quantizes the
  // gathered [m_total, n] high-precision tensor `all` (device memory, freed
  // by the caller on this thread's stream) into the outputs; on a
  // stream-ordered call on the channel's queue, this thread's stream after it.
  absl::Status QuantizeGathered(const void* all, bool stream_ordered);
  // Every rank's part, quantized and in the input's precision, into the
  // output (EXACT_FP8), or the whole tensor quantized from the gathered rows
  // (GATHER_HIGH_PRECISION).
  absl::Status AssembleOneRound(const kernels::OneRoundPlan& plan,
                                const std::vector<SlotLayout>& slots, const uint8_t* gathered,
                                uint64_t slot_bytes, int64_t esize, bool stream_ordered);

  // Any communicator failure leaves the ranks out of step, except
  // INVALID_ARGUMENT (communicator.h: nothing moved, or, for Gloo, ranks
  // that asked for different sizes found out in step): then only this call
  // fails, on every rank. Different sizes mean the ranks took different
  // paths or computed different payloads.
  absl::Status CommFailed(const absl::Status& s) {
    if (s.code() != absl::StatusCode::kInvalidArgument) {
      *group_broken = true;
      return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, s.message(),
        " (pass shard_rows on every rank of a call or on none; with it, the ranks must agree on "
        "shard_rows, N, dtype, mode and config)"));
  }
  void Lap(absl::Duration* d) {
    const absl::Time now = absl::Now();
    *d = now - mark;
    mark = now;
  }

  // The call.
  const AllGatherRequestSpec& request;
  const OpContext& ctx;
  backend::Communicator& comm;
  const backend::CommCall& call;
  bool* const group_broken;
  const int world;
  const int rank;
  const std::string prefix;
  const kernels::QuantizeParams& p;
  const bool exact;
  AllGatherTiming timing;
  absl::Time mark = absl::Now();

  // Step 1.
  absl::StatusOr<LocalRequest> local;
  std::array<std::optional<PlacedOutput>, 4> outs;
  bool early = false;
  absl::Status early_status;
  backend::DeviceBuffer early_shard;    // [m * n data | rowwise scales], EXACT_FP8
  std::function<void()> enqueue_early;  // the early quantize, run by the header exchange
  absl::Status early_launch;            // its outcome

  // Step 2.
  std::vector<WireHeader> headers;

  // Step 3.
  int64_t n = 0;
  std::vector<kernels::ShardGeometry> geoms;
  std::vector<int64_t> shard_rows;
  int64_t m_total = 0;
  kernels::QuantizedLayout layout;
  bool need_amax = false;
  int64_t amax_len = 0;
  backend::DeviceBuffer input_staging;
  const void* input_ptr = nullptr;
  std::vector<float> amax_first, amax_last;
  bool all_early = false;
  uint64_t block = 0;         // bytes per rank of the status exchange
  std::vector<uint8_t> recv;  // its result: status + first amax + last amax per rank
  kernels::QuantizedBuffers out_bufs;
};

absl::StatusOr<AllGatherResult> AllGatherCall::Run() {
  if (!request.shard_rows.empty()) return RunOneRound();
  ValidateLocally();
  Lap(&timing.local);
  QTX_RETURN_IF_ERROR(ExchangeHeaders());
  Lap(&timing.header);
  QTX_RETURN_IF_ERROR(PrepareOutputs());
  // Step 4. Collectives of the data plane: a stream-ordered call (a channel)
  // only enqueues them on this thread's stream; its completion is the
  // channel's done write, which SignalClient orders after all of it.
  const bool stream_ordered = request.events.queue != nullptr;
  backend::CommCall data_call = call;
  data_call.enqueue_only = stream_ordered;
  QTX_RETURN_IF_ERROR(exact ? GatherExact(data_call, stream_ordered)
                            : GatherHighPrecision(data_call, stream_ordered));
  return Finish();
}

void AllGatherCall::ValidateLocally() {
  // Step 1: local validation. A failure is still announced to the peers.
  local = ValidateLocal(request, ctx, comm);
  // The client's wait event orders every read of the shard below (the early
  // quantize, the boundary amaxes, the gather of a high-precision shard: all
  // on this thread's stream). A bad handle is announced like any local error.
  if (local.ok()) {
    if (absl::Status s = ctx.device->OrderAfterClient(request.events); !s.ok()) local = s;
  }

  // Step 1b: the early path (PrepareEarly). For EXACT_FP8 rowwise-only 1-D
  // the shard's quantization needs nothing from the peers (1x128 blocks never
  // straddle ranks, and its shard layout does not depend on the row offset),
  // so its scratch shard is allocated now and the quantize is enqueued while
  // the headers are exchanged (a device communicator moves them on its own
  // stream and launches the quantize once the exchange's kernel is queued);
  // the gather then sends from the scratch into the output.
  // Not for a stream-ordered call: its GPU work runs later anyway, so there
  // is no latency to hide, and quantizing straight into the output keeps the
  // gather of the rowwise data in place (no extra copy of the bulk).
  const bool early_quantize = exact && p.rowwise && !p.columnwise &&
                              p.scaling == kernels::BlockScaling::kBlock1D &&
                              request.events.queue == nullptr;
  // Every request whose tensors need no staging resolves its outputs early:
  // when all ranks do, the status exchange of step 3 is skipped and the
  // boundary amaxes travel on the device (step 4), so a stream-ordered call
  // never waits for its GPU work.
  if (local.ok()) {
    absl::StatusOr<bool> e = PrepareEarly(request, *local, ctx, outs);
    early = !e.ok() || *e;
    if (!e.ok()) early_status = e.status();
    if (!early) {
      for (auto& o : outs) o.reset();
    }
    const kernels::ShardGeometry g0{0, local->mn.m, local->mn.n};
    if (early && early_status.ok() && early_quantize && g0.m > 0) {
      const uint64_t data = static_cast<uint64_t>(g0.m * g0.n);
      const uint64_t scales = 4 * static_cast<uint64_t>(kernels::ShardRowwiseScaleCount(
                                      kernels::BlockScaling::kBlock1D, g0));
      // Round16(scales): the gather sends the packed shard's rounded size.
      absl::StatusOr<backend::DeviceBuffer> buf =
          ctx.device->Allocate(Round16(data) + Round16(scales));
      if (buf.ok()) {
        early_shard = std::move(*buf);
        auto* base = static_cast<uint8_t*>(early_shard.data());
        kernels::QuantizedBuffers b;
        b.rowwise_data = base;
        b.rowwise_scale_inv = reinterpret_cast<float*>(base + Round16(data));
        enqueue_early = [this, b, g0] {
          early_launch = ctx.device->QuantizeShard(
              backend::ShardArgs{local->input.data, local->dtype, g0, p}, nullptr, nullptr, b);
        };
      } else {
        early_status = buf.status();
      }
    }
  }
}

absl::Status AllGatherCall::ExchangeHeaders() {
  WireHeader mine;
  SetRequestFields(request, p, &mine);
  if (local.ok()) {
    mine.n = local->mn.n;
    mine.m = local->mn.m;
    mine.early = early ? 1 : 0;
    for (int i = 0; i < 4; ++i) mine.out_size[i] = outs[i] ? outs[i]->bytes : 0;
    mine.prepared = ToWire(early_status);
  } else {
    mine.status = ToWire(local.status());
  }
  headers.resize(world);
  if (absl::Status s =
          ExchangeFixed(&mine, sizeof(WireHeader), headers.data(), comm, call, enqueue_early);
      !s.ok()) {
    return CommFailed(s);
  }
  if (!early_launch.ok()) {
    // The peers have gone on towards the gather: this rank cannot follow.
    return CommFailed(absl::Status(
        early_launch.code(), absl::StrCat("the shard's quantize failed after the header exchange: ",
                                          early_launch.message())));
  }
  if (!local.ok()) return local.status();
  for (int r = 0; r < world; ++r) {
    if (headers[r].magic != kMagic) {
      *group_broken = true;
      return absl::InternalError(absl::StrFormat("%srank %d sent a malformed header", prefix, r));
    }
    if (headers[r].status.code != 0) {
      return FromWire(headers[r].status,
                      absl::StrFormat("%srank %d rejected its request: ", prefix, r));
    }
  }
  QTX_RETURN_IF_ERROR(CheckAgreement(headers, prefix));
  return absl::OkStatus();
}

absl::Status AllGatherCall::PrepareOutputs() {
  n = local->mn.n;
  geoms.resize(world);
  shard_rows.resize(world);
  for (int r = 0; r < world; ++r) {
    shard_rows[r] = headers[r].m;
    geoms[r] = kernels::ShardGeometry{m_total, headers[r].m, n};
    int64_t elements = 0;
    if (__builtin_add_overflow(m_total, headers[r].m, &m_total) ||
        __builtin_mul_overflow(m_total, n, &elements) || elements > ctx.limits.max_elements) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%sthe gathered tensor [sum M_r, N=%d] exceeds the element limit %d",
                          prefix, n, ctx.limits.max_elements));
    }
  }
  const kernels::ShardGeometry& g = geoms[rank];
  layout = kernels::ComputeLayout(p.scaling, m_total, n);
  // TENSOR: every rank needs the amax of the whole tensor, rowwise-only too.
  need_amax = exact && (p.columnwise || p.scaling != kernels::BlockScaling::kBlock1D);
  amax_len = need_amax ? kernels::BoundaryAmaxLength(p.scaling, g) : 0;

  input_ptr = local->input.data;
  amax_first.assign(amax_len, 0.0f);
  amax_last.assign(amax_len, 0.0f);
  all_early =
      std::all_of(headers.begin(), headers.end(), [](const WireHeader& h) { return h.early != 0; });
  if (all_early) {
    QTX_RETURN_IF_ERROR(EarlyVerdict());
  } else {
    // Re-placed below; an early quantization is not used.
    for (auto& o : outs) o.reset();
    early_shard = backend::DeviceBuffer();
  }
  const absl::Status prepared = all_early ? absl::OkStatus() : PlaceOutputs();

  // Status + first amax + last amax per rank (amax lengths agree: same N).
  block = sizeof(WireStatus) + 8 * amax_len;
  std::vector<uint8_t> send(block);
  recv.assign(block * world, 0);
  const WireStatus ws = ToWire(prepared);
  std::memcpy(send.data(), &ws, sizeof ws);
  if (amax_len > 0) {
    std::memcpy(send.data() + sizeof ws, amax_first.data(), 4 * amax_len);
    std::memcpy(send.data() + sizeof ws + 4 * amax_len, amax_last.data(), 4 * amax_len);
  }
  if (!all_early) {
    if (absl::Status s = ExchangeFixed(send.data(), block, recv.data(), comm, call); !s.ok()) {
      return CommFailed(s);
    }
  }
  if (!prepared.ok()) return prepared;
  for (int r = 0; r < world; ++r) {
    WireStatus rs;
    std::memcpy(&rs, recv.data() + r * block, sizeof rs);
    if (rs.code != 0) {
      return FromWire(rs, absl::StrFormat("%srank %d could not take part: ", prefix, r));
    }
  }
  for (auto& o : outs) AllocateInline(o);
  if (outs[0]) out_bufs.rowwise_data = static_cast<uint8_t*>(outs[0]->KernelPointer());
  if (outs[1]) out_bufs.rowwise_scale_inv = static_cast<float*>(outs[1]->KernelPointer());
  if (outs[2]) out_bufs.columnwise_data = static_cast<uint8_t*>(outs[2]->KernelPointer());
  if (outs[3]) out_bufs.columnwise_scale_inv = static_cast<float*>(outs[3]->KernelPointer());
  return absl::OkStatus();
}

// The early path's step 3: every rank evaluates every rank's outcome and
// slice sizes from the headers, so all reach the same verdict with no
// further exchange. (Nothing else in it can fail on one rank only before
// the data moves, except a device allocation or launch, which the other
// paths do not exchange either.)
absl::Status AllGatherCall::EarlyVerdict() {
  QTX_ASSIGN_OR_RETURN(const auto buffers, DescribeQuantizedOutputs(p, layout));
  auto size_error = [&](const WireHeader& h) -> absl::Status {
    for (int i = 0; i < 4; ++i) {
      if (buffers[i].requested && h.out_size[i] != buffers[i].bytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s.size=%d: expected %d", kQuantizedOutputFields[i], h.out_size[i], buffers[i].bytes));
      }
    }
    return absl::OkStatus();
  };
  if (!early_status.ok()) return early_status;
  QTX_RETURN_IF_ERROR(size_error(headers[rank]));
  for (int r = 0; r < world; ++r) {
    if (headers[r].prepared.code != 0) {
      return FromWire(headers[r].prepared,
                      absl::StrFormat("%srank %d could not take part: ", prefix, r));
    }
    if (absl::Status e = size_error(headers[r]); !e.ok()) {
      return absl::Status(
          e.code(), absl::StrFormat("%srank %d could not take part: %s", prefix, r, e.message()));
    }
  }
  for (int i = 0; i < 4; ++i) {
    if (!outs[i]) continue;
    outs[i]->tensor.dtype = buffers[i].dtype;
    outs[i]->tensor.shape = buffers[i].shape;
  }
  return absl::OkStatus();
}

absl::Status AllGatherCall::PlaceOutputs() {
  const kernels::ShardGeometry& g = geoms[rank];
  QTX_ASSIGN_OR_RETURN(const auto buffers, DescribeQuantizedOutputs(p, layout));
  QTX_RETURN_IF_ERROR(PlaceQuantizedOutputs(request.outputs, buffers, ctx, outs));
  QTX_RETURN_IF_ERROR(CheckNoOverlap(OutputRanges(local->input, outs)));
  uint64_t inline_bytes = 0;
  for (const auto& o : outs) {
    if (o && !o->slice) inline_bytes += o->bytes;
  }
  QTX_RETURN_IF_ERROR(CheckInlineBudget(inline_bytes, ctx, "AllGather"));
  QTX_ASSIGN_OR_RETURN(input_ptr, InputOnDevice(local->input, "input", ctx, input_staging));
  if (need_amax && g.m > 0) {
    backend::ShardArgs args{input_ptr, local->dtype, g, p};
    QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer d, ctx.device->Allocate(8 * amax_len));
    float* df = static_cast<float*>(d.data());
    QTX_RETURN_IF_ERROR(ctx.device->ShardBoundaryAmax(args, df, df + amax_len));
    std::vector<float> both(2 * amax_len);
    QTX_RETURN_IF_ERROR(ctx.device->CopyToHost(both.data(), df, 8 * amax_len));
    std::copy(both.begin(), both.begin() + amax_len, amax_first.begin());
    std::copy(both.begin() + amax_len, both.end(), amax_last.begin());
  }
  return absl::OkStatus();
}

absl::Status AllGatherCall::GatherExact(const backend::CommCall& data_call, bool stream_ordered) {
  const kernels::ShardGeometry& g = geoms[rank];
  std::vector<PackedShard> packs(world);
  std::vector<uint64_t> sizes(world);
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    packs[r] = PackShard(geoms[r], p);
    sizes[r] = packs[r].total;
    total += sizes[r];
  }
  const bool have_early = early_shard.data() != nullptr;
  backend::DeviceBuffer shard;
  if (!have_early) {
    QTX_ASSIGN_OR_RETURN(shard, ctx.device->Allocate(packs[rank].total));
  }
  QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer gathered, ctx.device->Allocate(total));
  // The combined boundary amaxes of this rank's shard: first | last.
  QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer amax_dev, ctx.device->Allocate(8 * amax_len));
  float* amax_ptr = static_cast<float*>(amax_dev.data());
  // Temporaries (amax_dev, amax_parts, shard, gathered) come from the
  // device's stream-ordered allocator on this thread's stream, and their
  // destructors free them on that stream (cudaFreeAsync), i.e. after every
  // kernel and collective enqueued here has used them, however long the
  // GPU takes to get there. Per-group scratch reused in stream order would
  // also do, but would have to grow to the largest call and be sized per
  // group; the pool already caches freed memory (no cudaMalloc per call).
  backend::DeviceBuffer amax_parts;
  if (amax_len > 0 && all_early) {
    // On the device: every rank's partial amaxes [world][first | last]
    // gathered in place, then combined by a kernel that reads them where
    // they landed. The host never sees an amax.
    const uint64_t per_rank = 8 * static_cast<uint64_t>(amax_len);
    QTX_ASSIGN_OR_RETURN(amax_parts, ctx.device->Allocate(per_rank * world));
    float* all = static_cast<float*>(amax_parts.data());
    float* mine = all + 2 * amax_len * rank;
    if (g.m > 0) {
      QTX_RETURN_IF_ERROR(ctx.device->ShardBoundaryAmax(
          backend::ShardArgs{input_ptr, local->dtype, g, p}, mine, mine + amax_len));
    }
    // (An empty shard's vectors are gathered unwritten: no rank reads them.)
    const std::vector<uint64_t> amax_sizes(world, per_rank);
    if (absl::Status s = comm.AllGatherV(mine, amax_sizes, all, data_call); !s.ok()) {
      return CommFailed(s);
    }
    QTX_RETURN_IF_ERROR(ctx.device->CombineBoundaryAmax(world, geoms.data(), all, amax_len, rank,
                                                        p.scaling, amax_ptr, amax_ptr + amax_len));
  } else if (amax_len > 0) {
    // The amaxes came with the status exchange (host bytes).
    std::vector<const float*> firsts(world), lasts(world);
    if (g.m > 0) {
      for (int r = 0; r < world; ++r) {
        const float* base =
            reinterpret_cast<const float*>(recv.data() + r * block + sizeof(WireStatus));
        firsts[r] = base;
        lasts[r] = base + amax_len;
      }
    }
    QTX_RETURN_IF_ERROR(ctx.device->CombineHostBoundaryAmax(world, geoms.data(), firsts.data(),
                                                            lasts.data(), amax_len, rank, p.scaling,
                                                            amax_ptr, amax_ptr + amax_len));
  }
  // The early shard holds [data | scales]; its scales section is this
  // rank's packed shard (rowwise-only: rw_scale = 0, total = scales).
  const uint64_t early_data = Round16(static_cast<uint64_t>(g.m * n));
  auto* sbase = have_early ? static_cast<uint8_t*>(early_shard.data()) + early_data
                           : static_cast<uint8_t*>(shard.data());
  const void* shard_send = sbase;
  const PackedShard& mp = packs[rank];
  kernels::QuantizedBuffers shard_bufs;
  if (p.rowwise) {
    shard_bufs.rowwise_data = have_early ? static_cast<uint8_t*>(early_shard.data())
                                         : out_bufs.rowwise_data + g.row_offset * n;
    shard_bufs.rowwise_scale_inv = reinterpret_cast<float*>(sbase + mp.rw_scale);
  }
  if (p.columnwise) {
    shard_bufs.columnwise_data = sbase + mp.cw_data;
    shard_bufs.columnwise_scale_inv = reinterpret_cast<float*>(sbase + mp.cw_scale);
  }
  if (g.m > 0 && !have_early) {
    backend::ShardArgs args{input_ptr, local->dtype, g, p};
    QTX_RETURN_IF_ERROR(ctx.device->QuantizeShard(
        args, amax_len ? amax_ptr : nullptr, amax_len ? amax_ptr + amax_len : nullptr, shard_bufs));
  }
  Lap(&timing.prepare);
  // The rowwise data (in place in the output) and the packed rest in one
  // communicator step (one NCCL launch).
  std::vector<uint64_t> data_sizes(world);
  std::vector<backend::Communicator::GatherPart> parts;
  if (p.rowwise) {
    for (int r = 0; r < world; ++r) data_sizes[r] = static_cast<uint64_t>(geoms[r].m * n);
    parts.push_back({shard_bufs.rowwise_data, data_sizes, out_bufs.rowwise_data});
  }
  parts.push_back({shard_send, sizes, gathered.data()});
  if (absl::Status s = comm.AllGatherVParts(parts, data_call); !s.ok()) {
    return CommFailed(s);
  }
  Lap(&timing.gather);
  std::vector<kernels::QuantizedConstBuffers> views(world);
  uint64_t off = 0;
  auto* gbase = static_cast<const uint8_t*>(gathered.data());
  for (int r = 0; r < world; ++r) {
    const uint8_t* b = gbase + off;
    if (p.rowwise) {
      views[r].rowwise_data = out_bufs.rowwise_data + geoms[r].row_offset * n;
      views[r].rowwise_scale_inv = reinterpret_cast<const float*>(b + packs[r].rw_scale);
    }
    if (p.columnwise) {
      views[r].columnwise_data = b + packs[r].cw_data;
      views[r].columnwise_scale_inv = reinterpret_cast<const float*>(b + packs[r].cw_scale);
    }
    off += sizes[r];
  }
  QTX_RETURN_IF_ERROR(ctx.device->AssembleShards(world, geoms.data(), views.data(), p, out_bufs));
  // A synchronous call returns with its outputs written; a stream-ordered
  // one only enqueued them.
  if (!stream_ordered) QTX_RETURN_IF_ERROR(ctx.device->SynchronizeThisThread());
  return absl::OkStatus();
}

absl::Status AllGatherCall::GatherHighPrecision(const backend::CommCall& data_call,
                                                bool stream_ordered) {
  const int64_t esize = tensor::ElementSize(request.input.dtype);
  std::vector<uint64_t> sizes(world);
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    sizes[r] = static_cast<uint64_t>(geoms[r].m * n * esize);
    total += sizes[r];
  }
  QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer gathered, ctx.device->Allocate(total));
  Lap(&timing.prepare);
  if (absl::Status s = comm.AllGatherV(input_ptr, sizes, gathered.data(), data_call); !s.ok()) {
    return CommFailed(s);
  }
  Lap(&timing.gather);
  return QuantizeGathered(total > 0 ? gathered.data() : nullptr, stream_ordered);
}

absl::Status AllGatherCall::QuantizeGathered(const void* all, bool stream_ordered) {
  backend::QuantizeArgs args;
  args.input = all;
  args.dtype = local->dtype;
  args.m = m_total;
  args.n = n;
  args.params = p;
  args.out = out_bufs;
  if (!stream_ordered) return ctx.device->Quantize(args);
  // The channel's queue after this thread's gather and copies, the quantize
  // enqueued on the queue, then this thread's stream after the quantize:
  // `all` is freed on this stream, so only once the quantize has read it.
  QTX_RETURN_IF_ERROR(ctx.device->SignalClient(request.events));
  args.queue = request.events.queue;
  QTX_RETURN_IF_ERROR(ctx.device->Quantize(args));
  return ctx.device->OrderAfterClient(request.events);
}

absl::Status AllGatherCall::CheckShardRows(bool* usable) const {
  *usable = false;
  const std::vector<int64_t>& rows = request.shard_rows;
  if (rows.size() != static_cast<size_t>(world)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard_rows has %d entries: the group has %d ranks (one M_r per rank)",
                        rows.size(), world));
  }
  int64_t total = 0, elements = 0;
  for (int r = 0; r < world; ++r) {
    if (rows[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shard_rows[%d]=%d: must be >= 0", r, rows[r]));
    }
    if (__builtin_add_overflow(total, rows[r], &total)) total = INT64_MAX;
  }
  if (total == INT64_MAX || __builtin_mul_overflow(total, n, &elements) ||
      elements > ctx.limits.max_elements) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the gathered tensor [sum shard_rows, N=%d] exceeds the element limit %d",
                        n, ctx.limits.max_elements));
  }
  *usable = true;
  if (local.ok() && rows[rank] != local->mn.m) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard_rows[%d]=%d but this rank's input has %d rows (input.shape flattened to [M_r, N])",
        rank, rows[rank], local->mn.m));
  }
  return absl::OkStatus();
}

// The verdict on the gathered one-round headers `h` (world of them), the
// same on every rank: the one parse and check of the slot headers, used by
// the synchronous path before assembly and by a stream-ordered call's
// completion check after the device has compared them (CheckSlotHeaders).
// `mine` is this rank's own verdict, reported in preference to the peers'
// (but after a broken transport, which the group must learn of: then
// *broken is set).
absl::Status SlotVerdict(const OneRoundHeader* h, int world, uint64_t slot_bytes,
                         const absl::Status& mine, std::span<const int64_t> shard_rows,
                         const std::string& prefix, bool* broken) {
  // A slot that does not start with a header of this build, or whose sender
  // computed another slot size, means the ranks issued all-gathers of
  // different sizes: the transport may be out of step, so the group is
  // broken (as after any communicator failure).
  for (int r = 0; r < world; ++r) {
    if (h[r].magic != kOneRoundMagic || h[r].header_bytes != sizeof(OneRoundHeader) ||
        h[r].rank != r || h[r].slot_bytes != slot_bytes) {
      *broken = true;
      return absl::InvalidArgumentError(absl::StrFormat(
          "%srank %d's payload does not match this rank's (%s): the ranks disagree on "
          "shard_rows, N, dtype, mode or config, or not every rank passed shard_rows; the group "
          "is now broken",
          prefix, r,
          h[r].magic == kOneRoundMagic
              ? absl::StrFormat("it computed %d bytes per rank, this rank %d", h[r].slot_bytes,
                                slot_bytes)
              : std::string("no one-round header")));
    }
  }
  if (!mine.ok()) return mine;
  for (int r = 0; r < world; ++r) {
    if (h[r].status.code != 0) {
      return FromWire(h[r].status, absl::StrFormat("%srank %d rejected its request: ", prefix, r));
    }
  }
  // Every rank compares every header with rank 0's: all reach the same
  // verdict and the same message.
  for (int r = 1; r < world; ++r) {
    if (h[r].digest == h[0].digest && AgreementDigest(h[r]) == h[r].digest) continue;
    std::string diff = FirstDifference(h[0], 0, h[r], r);
    if (diff.empty()) diff = absl::StrFormat("digest: rank %d's does not match its fields", r);
    return absl::InvalidArgumentError(absl::StrCat(prefix, "ranks disagree on ", diff));
  }
  for (int r = 0; r < world; ++r) {
    if (h[r].local_rows != shard_rows[r]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%sshard_rows[%d]=%d but rank %d's input has %d rows", prefix, r,
                          shard_rows[r], r, h[r].local_rows));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<AllGatherResult> AllGatherCall::RunOneRound() {
  const bool stream_ordered = request.events.queue != nullptr;
  backend::CommCall data_call = call;
  data_call.enqueue_only = stream_ordered;
  // Local validation; its verdict travels in this rank's header, so that
  // every rank fails with it.
  local = ValidateLocal(request, ctx, comm);
  if (local.ok()) {
    if (absl::Status s = ctx.device->OrderAfterClient(request.events); !s.ok()) local = s;
  }
  // The slot layout needs N and the element size: the request's claims
  // when it was rejected (the peers' slots have the size they compute from
  // theirs; if it differs, SlotVerdict or the communicator says so).
  if (local.ok()) {
    n = local->mn.n;
  } else if (!request.input.shape.empty() && request.input.shape.back() > 0) {
    n = request.input.shape.back();
  }
  const int64_t esize = std::max<int64_t>(1, tensor::ElementSize(request.input.dtype));
  absl::Status mine = local.status();
  bool rows_usable = false;
  const absl::Status rows_status = CheckShardRows(&rows_usable);
  if (mine.ok()) mine = rows_status;
  // A list that cannot describe a tensor (wrong length, negative, too large)
  // plans as empty shards (a header-only slot) rather than as sizes that
  // cannot be allocated; one that only contradicts this rank's input is
  // still the layout the peers compute.
  std::vector<int64_t> rows(world, 0);
  if (rows_usable) rows = request.shard_rows;
  // TENSOR: no block row straddles ranks in the plan. Every rank casts its
  // whole shard with the amax of the whole tensor, reduced over the ranks in
  // a small all-gather before the slots' (two collectives, no host wait).
  const bool tensor = exact && p.scaling == kernels::BlockScaling::kTensor;
  const bool split =
      exact && !tensor && (p.columnwise || p.scaling == kernels::BlockScaling::kBlock2D);
  const kernels::OneRoundPlan plan = kernels::PlanOneRound(rows, n, split);
  m_total = plan.m_total;
  shard_rows = rows;
  geoms.resize(world);
  for (int r = 0; r < world; ++r) {
    geoms[r] = kernels::ShardGeometry{plan.shards[r].row_offset, plan.shards[r].m, n};
  }
  layout = kernels::ComputeLayout(p.scaling, m_total, n);
  std::vector<SlotLayout> slots(world);
  uint64_t slot_bytes = 0;
  for (int r = 0; r < world; ++r) {
    slots[r] = LayoutSlot(plan.shards[r], n, esize, p, exact);
    slot_bytes = std::max(slot_bytes, slots[r].total);
  }
  // The outputs (sizes known from shard_rows): a bad slice is this rank's
  // verdict too.
  need_amax = false;
  if (mine.ok()) mine = PlaceOutputs();
  Lap(&timing.local);

  QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer gathered,
                       ctx.device->Allocate(slot_bytes * static_cast<uint64_t>(world)));
  auto* base = static_cast<uint8_t*>(gathered.data());
  uint8_t* my = base + slot_bytes * rank;
  OneRoundHeader hdr;
  hdr.slot_bytes = slot_bytes;
  SetRequestFields(request, p, &hdr);
  hdr.n = n;
  hdr.world = world;
  hdr.rank = rank;
  hdr.shard_rows_digest = ShardRowsDigest(request.shard_rows);
  hdr.local_rows = local.ok() ? local->mn.m : -1;
  hdr.status = ToWire(mine);
  hdr.header_bytes = sizeof(OneRoundHeader);
  hdr.digest = AgreementDigest(hdr);
  // Host-visible memory for the slot check (no host wait to move it):
  // [this rank's header | the verdict word | every rank's header as
  // gathered]. The header goes into the slot by a stream-ordered copy.
  constexpr uint64_t kHeader = sizeof(OneRoundHeader);
  const uint64_t verdict_at = Round16(kHeader), copies_at = verdict_at + 16;
  QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer check_mem,
                       ctx.device->AllocateHostVisible(copies_at + kHeader * world));
  auto* check = static_cast<uint8_t*>(check_mem.data());
  std::memcpy(check, &hdr, kHeader);
  QTX_RETURN_IF_ERROR(ctx.device->CopyOnDevice(my, check, kHeader));
  // TENSOR: every rank's shard amax ([world][first | last], as the two-round
  // path gathers boundary amaxes), then the combined pair after them. A rank
  // whose request was bad still takes part (its slot fails every rank later).
  backend::DeviceBuffer amax_mem;
  const float* tensor_amax = nullptr;
  if (tensor) {
    QTX_ASSIGN_OR_RETURN(amax_mem, ctx.device->Allocate(8 * static_cast<uint64_t>(world + 1)));
    float* all = static_cast<float*>(amax_mem.data());
    float* own = all + 2 * rank;
    if (mine.ok() && geoms[rank].m > 0) {
      QTX_RETURN_IF_ERROR(ctx.device->ShardBoundaryAmax(
          backend::ShardArgs{input_ptr, local->dtype, geoms[rank], p}, own, own + 1));
    }
    const std::vector<uint64_t> amax_sizes(world, 8);
    if (absl::Status s = comm.AllGatherV(own, amax_sizes, all, data_call); !s.ok()) {
      return CommFailed(s);
    }
    float* combined = all + 2 * world;
    QTX_RETURN_IF_ERROR(ctx.device->CombineBoundaryAmax(world, geoms.data(), all, 1, rank,
                                                        p.scaling, combined, combined + 1));
    tensor_amax = combined;
  }
  if (mine.ok()) {
    // This rank's part: its interior block rows quantized straight into its
    // slot, and its rows of straddling block rows as they are.
    const kernels::OneRoundShard& s = plan.shards[rank];
    const SlotLayout& sl = slots[rank];
    const auto* in = static_cast<const uint8_t*>(input_ptr);
    const uint64_t row_bytes = static_cast<uint64_t>(n * esize);
    if (!exact) {
      QTX_RETURN_IF_ERROR(ctx.device->CopyOnDevice(my + sl.rows, in, s.m * row_bytes));
    } else {
      if (s.interior.m > 0) {
        QTX_RETURN_IF_ERROR(ctx.device->QuantizeShard(
            backend::ShardArgs{in + s.head_rows * row_bytes, local->dtype, s.interior, p},
            tensor_amax, tensor_amax != nullptr ? tensor_amax + 1 : nullptr,
            BuffersAt(my, p, sl.rw_data, sl.rw_scale, sl.cw_data, sl.cw_scale)));
      }
      QTX_RETURN_IF_ERROR(ctx.device->CopyOnDevice(my + sl.head, in, s.head_rows * row_bytes));
      QTX_RETURN_IF_ERROR(ctx.device->CopyOnDevice(
          my + sl.tail, in + (s.m - s.tail_rows) * row_bytes, s.tail_rows * row_bytes));
    }
  }
  Lap(&timing.prepare);
  // The one round: equal slots, this rank's already in place.
  const std::vector<uint64_t> sizes(world, slot_bytes);
  if (absl::Status s = comm.AllGatherV(my, sizes, base, data_call); !s.ok()) {
    return CommFailed(s);
  }
  Lap(&timing.gather);
  // The slot check, on the device after the gather: every header against
  // this rank's (Device::CheckSlotHeaders), every header copied out.
  QTX_RETURN_IF_ERROR(ctx.device->CheckSlotHeaders(
      backend::SlotHeaderCheck{.slots = base,
                               .slot_stride = slot_bytes,
                               .count = world,
                               .expected = check,
                               .header_bytes = kHeader,
                               .agreed_bytes = kAgreedBytes,
                               .rank_offset = offsetof(OneRoundHeader, rank),
                               .status_offset = kStatusCodeOffset,
                               .headers_out = check + copies_at,
                               .bad = reinterpret_cast<uint32_t*>(check + verdict_at)}));
  // The explanation, from the copies, once the check has run: the same
  // verdict and message on every rank (SlotVerdict).
  auto verdict = [check, copies_at, verdict_at, world = world, slot_bytes,
                  rows = request.shard_rows,
                  prefix = prefix](const absl::Status& mine, bool* broken) -> absl::Status {
    std::vector<OneRoundHeader> h(world);
    std::memcpy(h.data(), check + copies_at, sizeof(OneRoundHeader) * world);
    uint32_t bad = 0;
    std::memcpy(&bad, check + verdict_at, 4);
    absl::Status v = SlotVerdict(h.data(), world, slot_bytes, mine, rows, prefix, broken);
    if (v.ok() && bad != 0) {
      v = absl::InternalError(absl::StrCat(
          prefix, "the device's slot check failed but the headers agree (a corrupted slot?)"));
    }
    return v;
  };
  if (!stream_ordered) {
    // A synchronous call: one wait, then no output is written unless every
    // slot passed.
    QTX_RETURN_IF_ERROR(ctx.device->SynchronizeThisThread());
    QTX_RETURN_IF_ERROR(verdict(mine, group_broken));
  } else if (!mine.ok()) {
    // This rank's own request was bad: the peers learn it from its slot.
    return mine;
  }
  QTX_RETURN_IF_ERROR(AssembleOneRound(plan, slots, base, slot_bytes, esize, stream_ordered));
  QTX_ASSIGN_OR_RETURN(AllGatherResult result, Finish());
  result.one_round = true;
  if (stream_ordered) {
    // Nothing waited for the check: the channel runs this once the call's
    // device work has completed (AllGatherResult::completion_check). The
    // outputs were written either way; a failure here means they are never
    // reported valid.
    auto mem = std::make_shared<backend::DeviceBuffer>(std::move(check_mem));
    result.completion_check = [mem, verdict]() {
      bool broken = false;
      return verdict(absl::OkStatus(), &broken);
    };
  }
  return result;
}

absl::Status AllGatherCall::AssembleOneRound(const kernels::OneRoundPlan& plan,
                                             const std::vector<SlotLayout>& slots,
                                             const uint8_t* gathered, uint64_t slot_bytes,
                                             int64_t esize, bool stream_ordered) {
  for (auto& o : outs) AllocateInline(o);
  if (outs[0]) out_bufs.rowwise_data = static_cast<uint8_t*>(outs[0]->KernelPointer());
  if (outs[1]) out_bufs.rowwise_scale_inv = static_cast<float*>(outs[1]->KernelPointer());
  if (outs[2]) out_bufs.columnwise_data = static_cast<uint8_t*>(outs[2]->KernelPointer());
  if (outs[3]) out_bufs.columnwise_scale_inv = static_cast<float*>(outs[3]->KernelPointer());
  const uint64_t row_bytes = static_cast<uint64_t>(n * esize);
  auto slot = [&](int r) { return gathered + slot_bytes * r; };
  if (!exact) {
    // The shards' rows, concatenated, then quantized as one tensor.
    QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer all, ctx.device->Allocate(m_total * row_bytes));
    auto* dst = static_cast<uint8_t*>(all.data());
    for (int r = 0; r < world; ++r) {
      const kernels::OneRoundShard& s = plan.shards[r];
      QTX_RETURN_IF_ERROR(ctx.device->CopyOnDevice(dst + s.row_offset * row_bytes,
                                                   slot(r) + slots[r].rows, s.m * row_bytes));
    }
    return QuantizeGathered(m_total > 0 ? all.data() : nullptr, stream_ordered);
  }
  // Pieces of the output: every rank's interior rows from its slot, then the
  // straddling block rows, each rebuilt from the rows its ranks sent and
  // quantized here (kernels/one_round_plan.h says why this is exact).
  std::vector<kernels::ShardGeometry> piece_geoms;
  std::vector<kernels::QuantizedConstBuffers> views;
  for (int r = 0; r < world; ++r) {
    const kernels::ShardGeometry& g = plan.shards[r].interior;
    if (g.m == 0) continue;
    const uint8_t* b = slot(r);
    kernels::QuantizedConstBuffers v;
    if (p.rowwise) {
      v.rowwise_data = b + slots[r].rw_data;
      v.rowwise_scale_inv = reinterpret_cast<const float*>(b + slots[r].rw_scale);
    }
    if (p.columnwise) {
      v.columnwise_data = b + slots[r].cw_data;
      v.columnwise_scale_inv = reinterpret_cast<const float*>(b + slots[r].cw_scale);
    }
    piece_geoms.push_back(g);
    views.push_back(v);
  }
  // One scratch buffer for every straddling block row: its rows in the
  // input's precision, then its quantized copies in the shard layout.
  struct Scratch {
    uint64_t rows = 0, rw_data = 0, rw_scale = 0, cw_data = 0, cw_scale = 0;
  };
  std::vector<Scratch> scratch(plan.straddles.size());
  uint64_t total = 0;
  for (size_t i = 0; i < plan.straddles.size(); ++i) {
    const kernels::ShardGeometry& g = plan.straddles[i].geom;
    Scratch& sc = scratch[i];
    sc.rows = total;
    total += Round16(g.m * row_bytes);
    sc.rw_data = total;
    total += Round16(static_cast<uint64_t>(g.m * n));
    sc.rw_scale = total;
    total += Round16(4 * static_cast<uint64_t>(kernels::ShardRowwiseScaleCount(p.scaling, g)));
    sc.cw_data = total;
    total += Round16(static_cast<uint64_t>(g.m * n));
    sc.cw_scale = total;
    total += Round16(4 * static_cast<uint64_t>(kernels::ShardColumnwiseScaleCount(p.scaling, g)));
  }
  QTX_ASSIGN_OR_RETURN(backend::DeviceBuffer sbuf, ctx.device->Allocate(total));
  auto* sb = static_cast<uint8_t*>(sbuf.data());
  for (size_t i = 0; i < plan.straddles.size(); ++i) {
    const kernels::StraddleBlock& blk = plan.straddles[i];
    const Scratch& sc = scratch[i];
    uint64_t at = sc.rows;
    for (const kernels::StraddleBlock::Piece& piece : blk.pieces) {
      const uint8_t* src =
          slot(piece.rank) + (piece.tail ? slots[piece.rank].tail : slots[piece.rank].head);
      QTX_RETURN_IF_ERROR(ctx.device->CopyOnDevice(sb + at, src, piece.rows * row_bytes));
      at += piece.rows * row_bytes;
    }
    const kernels::QuantizedBuffers b =
        BuffersAt(sb, p, sc.rw_data, sc.rw_scale, sc.cw_data, sc.cw_scale);
    QTX_RETURN_IF_ERROR(ctx.device->QuantizeShard(
        backend::ShardArgs{sb + sc.rows, local->dtype, blk.geom, p}, nullptr, nullptr, b));
    piece_geoms.push_back(blk.geom);
    views.push_back(
        {b.rowwise_data, b.rowwise_scale_inv, b.columnwise_data, b.columnwise_scale_inv});
  }
  // In row order (the CUDA assembly wants contiguous pieces in order; they
  // partition [0, M), so sorting by offset makes them so).
  std::vector<size_t> order(piece_geoms.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return piece_geoms[a].row_offset < piece_geoms[b].row_offset;
  });
  std::vector<kernels::ShardGeometry> sorted_geoms;
  std::vector<kernels::QuantizedConstBuffers> sorted_views;
  for (size_t i : order) {
    sorted_geoms.push_back(piece_geoms[i]);
    sorted_views.push_back(views[i]);
  }
  QTX_RETURN_IF_ERROR(ctx.device->AssembleShards(static_cast<int>(sorted_geoms.size()),
                                                 sorted_geoms.data(), sorted_views.data(), p,
                                                 out_bufs));
  // A synchronous call returns with its outputs written (and `sbuf`, freed
  // on this thread's stream, outlives the work either way).
  if (!stream_ordered) QTX_RETURN_IF_ERROR(ctx.device->SynchronizeThisThread());
  return absl::OkStatus();
}

absl::StatusOr<AllGatherResult> AllGatherCall::Finish() {
  for (auto& o : outs) QTX_RETURN_IF_ERROR(CopyBack(o, *ctx.device));
  QTX_RETURN_IF_ERROR(ctx.device->SignalClient(request.events));
  Lap(&timing.assemble);
  // A shm region of this rank truncated under the call (shm_fault_guard.h):
  // its result is not the client's data. (Peers cannot tell: they received
  // zeros in place of the lost part of this rank's shard.)
  if (local.ok()) QTX_RETURN_IF_ERROR(tensor::CheckIntact(local->input.pin));
  for (const auto& o : outs) {
    if (o && o->slice.has_value()) QTX_RETURN_IF_ERROR(tensor::CheckIntact(o->slice->pin));
  }

  AllGatherResult result;
  result.timing = timing;
  result.shard_rows = std::move(shard_rows);
  result.result.shape = {m_total, n};
  result.result.source_dtype = request.input.dtype;
  result.result.params = p;
  if (outs[0]) result.result.rowwise_data = std::move(outs[0]->tensor);
  if (outs[1]) result.result.rowwise_scale_inv = std::move(outs[1]->tensor);
  if (outs[2]) result.result.columnwise_data = std::move(outs[2]->tensor);
  if (outs[3]) result.result.columnwise_scale_inv = std::move(outs[3]->tensor);
  return result;
}

}  // namespace

std::string_view AllGatherModeName(AllGatherMode m) {
  switch (m) {
    case AllGatherMode::kExactFp8:
      return "EXACT_FP8";
    case AllGatherMode::kGatherHighPrecision:
      return "GATHER_HIGH_PRECISION";
  }
  return "UNKNOWN";
}

absl::StatusOr<AllGatherResult> AllGather(const AllGatherRequestSpec& request, const OpContext& ctx,
                                          backend::Communicator& comm,
                                          const backend::CommCall& call, bool* group_broken) {
  *group_broken = false;
  return AllGatherCall(request, ctx, comm, call, group_broken).Run();
}

}  // namespace qtx::server::ops

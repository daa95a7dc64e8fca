// qtx._native: the compiled half of qtx.cuda (client/python/qtx/cuda.py).
//
// A thin pybind11 layer over the C++ client: qtx::Client, qtx::Channel
// opened by qtx::cuda::OpenChannel on the caller's CUDA streams, and
// qtx::cuda::RegionCache for device pointers. It takes raw numbers (device
// ordinals, cudaStream_t handles, device pointers, shapes) that the Python
// layer has already checked and resolved from PyTorch / CuPy / any
// __cuda_array_interface__ or DLPack object; it never touches a framework.
//
// Errors: a failed absl::Status raises the qtx.errors class of its code
// (qtx.errors.from_status(code, message)); CUDA failures are INTERNAL.
//
// Threads: every NativeSession call takes the session's mutex, so a session
// may be shared by Python threads; calls are serialized (the submission order
// on one stream is the order of the calls). Calls that may block for long
// (Synchronize, synchronous RPCs) release the GIL first; submit_quantize (the
// fast path) keeps it while the mutex is free (a submission takes a few
// microseconds and does not wait for qtxd: releasing and re-taking the GIL
// would cost more, and a thread waiting for the GIL could delay the return by
// its switch interval), and releases it to wait for the mutex and to open a
// stream's channel (first call on it). The first use of an allocation
// registers it with qtxd (one RPC) with the GIL held, as PyTorch holds it
// while its caching allocator calls cudaMalloc.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/collective_types.h"
#include "qtx/cuda_channel.h"
#include "qtx/cuda_columnwise.h"
#include "qtx/cuda_ipc.h"
#include "qtx/optimizer_types.h"
#include "qtx/types.h"

namespace py = pybind11;

namespace {

// A failed status on its way to Python (see the translator in the module).
struct StatusException {
  int code;
  std::string message;
};

[[noreturn]] void Throw(const absl::Status& s) {
  throw StatusException{static_cast<int>(s.code()), std::string(s.message())};
}
void Check(const absl::Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Unwrap(absl::StatusOr<T> v) {
  if (!v.ok()) Throw(v.status());
  return *std::move(v);
}
void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    Throw(absl::InternalError(
        absl::StrFormat("%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e))));
  }
}
void UseDevice(int device) {
  // In a thread that never made a CUDA runtime call, cudaGetDevice reports
  // device 0 without a current context, and the region cache's driver calls
  // (cuMemGetAddressRange) then fail, which the H200 run of 2026-12-02
  // showed for a Session stepped from a new Python thread. So each thread
  // calls cudaSetDevice once (since CUDA 12 it makes the primary context
  // current at once); after that only when the thread's device differs
  // (a cudaGetDevice, a thread-local read, on the quantize hot path).
  thread_local bool context_made_current = false;
  int current = -1;
  if (context_made_current && cudaGetDevice(&current) == cudaSuccess && current == device) return;
  CheckCuda(cudaSetDevice(device), "cudaSetDevice");
  context_made_current = true;
}

// (pointer, bytes) of a device buffer, or None.
using Buf = std::optional<std::pair<uintptr_t, uint64_t>>;

qtx::QuantizeConfig MakeConfig(int mode, int format, bool rowwise, bool columnwise, bool pow2,
                               float eps) {
  qtx::QuantizeConfig c;
  c.scaling_mode = static_cast<qtx::ScalingMode>(mode);
  c.format = static_cast<qtx::Fp8Format>(format);
  c.rowwise = rowwise;
  c.columnwise = columnwise;
  c.force_pow2_scales = pow2;
  c.amax_epsilon = eps;
  return c;
}

class NativeSession {
 public:
  NativeSession(const std::string& target, const std::string& flag_memory, const std::string& label,
                double timeout_s, bool background_writer)
      : label_(label), background_writer_(background_writer) {
    if (flag_memory == "host") {
      flags_ = qtx::cuda::FlagMemory::kHostShm;
    } else if (flag_memory == "device") {
      flags_ = qtx::cuda::FlagMemory::kDevice;
    } else {
      Throw(absl::InvalidArgumentError(
          absl::StrFormat("flag_memory='%s': must be 'host' or 'device'", flag_memory)));
    }
    qtx::ClientOptions options;
    options.timeout = absl::Seconds(timeout_s);
    client_ = Unwrap(qtx::Client::Connect(target, options));
    // Region names are per qtxd: unique per process and session, so that
    // several sessions (of one process or of several) can share a qtxd.
    static std::atomic<uint64_t> sessions{0};
    cache_ = std::make_unique<qtx::cuda::RegionCache>(
        *client_, absl::StrFormat("qtx-py-%d-%d", ::getpid(), sessions.fetch_add(1)));
  }

  ~NativeSession() {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> l(mu_);
    (void)CloseLocked();
  }

  std::string Health() {
    py::gil_scoped_release nogil;
    auto s = Unwrap(client_->Health());
    return qtx::ServingStatusName(s);
  }

  // Client::WaitUntilServing: health checks until SERVING, up to timeout_s.
  void WaitUntilServing(double timeout_s) {
    py::gil_scoped_release nogil;
    Check(client_->WaitUntilServing(absl::Seconds(timeout_s)));
  }

  // Submits a quantization of the contiguous tensor at `input` on `stream`.
  // outs: rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv.
  uint64_t Quantize(int device, uintptr_t stream, uintptr_t input, int dtype,
                    const std::vector<int64_t>& shape, int mode, int format, bool rowwise,
                    bool columnwise, bool pow2, float eps, const std::vector<Buf>& outs) {
    const bool prof = profiling_.load(std::memory_order_relaxed);
    const Clock::time_point t0 = prof ? Clock::now() : Clock::time_point();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> l(mu_);
    qtx::Channel& ch = ChannelLocked(device, stream);
    const qtx::Tensor in = InputTensor(input, dtype, shape);
    const qtx::QuantizeOutputs o = Outputs(outs);
    const Clock::time_point t1 = prof ? Clock::now() : Clock::time_point();
    const uint64_t op =
        Unwrap(ch.Quantize(in, MakeConfig(mode, format, rowwise, columnwise, pow2, eps), o));
    if (prof) Account(t0, t1, Clock::now());
    return op;
  }

  // Quantize with flat arguments (what qtx.cuda's fast path passes: no
  // lists of tuples to convert): the four outputs as (pointer, bytes) pairs,
  // pointer 0 for a copy not requested.
  uint64_t QuantizeInto(int device, uintptr_t stream, uintptr_t input, int dtype,
                        const std::vector<int64_t>& shape, int mode, int format, bool rowwise,
                        bool columnwise, bool pow2, float eps, uintptr_t rd, uint64_t rdb,
                        uintptr_t rs, uint64_t rsb, uintptr_t cd, uint64_t cdb, uintptr_t cs,
                        uint64_t csb) {
    const bool prof = profiling_.load(std::memory_order_relaxed);
    const Clock::time_point t0 = prof ? Clock::now() : Clock::time_point();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> l(mu_);
    qtx::Channel& ch = ChannelLocked(device, stream);
    const qtx::Tensor in = InputTensor(input, dtype, shape);
    qtx::QuantizeOutputs o;
    if (rd != 0) o.rowwise_data = SliceLocked(rd, rdb);
    if (rs != 0) o.rowwise_scale_inv = SliceLocked(rs, rsb);
    if (cd != 0) o.columnwise_data = SliceLocked(cd, cdb);
    if (cs != 0) o.columnwise_scale_inv = SliceLocked(cs, csb);
    const Clock::time_point t1 = prof ? Clock::now() : Clock::time_point();
    const uint64_t op =
        Unwrap(ch.Quantize(in, MakeConfig(mode, format, rowwise, columnwise, pow2, eps), o));
    if (prof) Account(t0, t1, Clock::now());
    return op;
  }

  // A quantization plan: what submit_quantize needs besides the pointers,
  // for inputs of `dtype` and `shape` quantized with the config, whose
  // outputs have these byte sizes (0: the copy is not requested). Returns
  // its id. Plans are never dropped (qtx.cuda makes one per (shape, dtype,
  // config) it sees, memoized).
  int QuantizePlan(int dtype, const std::vector<int64_t>& shape, int mode, int format, bool rowwise,
                   bool columnwise, bool pow2, float eps, uint64_t rdb, uint64_t rsb, uint64_t cdb,
                   uint64_t csb) {
    Plan p;
    p.dtype = static_cast<qtx::DType>(dtype);
    p.shape = shape;
    p.input_bytes = static_cast<uint64_t>(Unwrap(qtx::NumElements(shape))) *
                    static_cast<uint64_t>(qtx::DTypeSize(p.dtype));
    p.config = MakeConfig(mode, format, rowwise, columnwise, pow2, eps);
    p.out_bytes = {rdb, rsb, cdb, csb};
    std::lock_guard<std::mutex> l(mu_);
    plans_.push_back(std::move(p));
    return static_cast<int>(plans_.size() - 1);
  }

  // The fast path's submission (module function submit_quantize): plan
  // `plan` on (device, stream), input at `input`, outputs at out[i] (0: not
  // requested). REQUIRES: the GIL is held; returns with it held.
  uint64_t SubmitQuantize(int plan, int device, uintptr_t stream, uintptr_t input,
                          const uintptr_t out[4]) {
    const bool prof = profiling_.load(std::memory_order_relaxed);
    const Clock::time_point t0 = prof ? Clock::now() : Clock::time_point();
    // nogil before l: on the way out the mutex is released before the GIL is
    // taken again (never wait for the GIL while holding mu_).
    std::optional<py::gil_scoped_release> nogil;
    std::unique_lock<std::mutex> l(mu_, std::try_to_lock);
    if (!l.owns_lock()) {
      nogil.emplace();  // another thread holds the session: wait without the GIL
      l.lock();
    }
    if (plan < 0 || static_cast<size_t>(plan) >= plans_.size()) {
      Throw(absl::InvalidArgumentError(absl::StrFormat("plan %d: not made by this session", plan)));
    }
    const Plan& p = plans_[plan];
    // The first call on a stream opens its channel, which waits for qtxd:
    // without the GIL (releasing it while holding mu_ is fine; only taking
    // it back waits, after mu_ is released).
    if (!nogil && channels_.find({device, stream}) == channels_.end()) nogil.emplace();
    qtx::Channel& ch = ChannelLocked(device, stream);
    const qtx::Tensor in =
        qtx::Tensor::InRegion(p.dtype, p.shape, SliceLocked(input, p.input_bytes));
    qtx::QuantizeOutputs o;
    std::optional<qtx::RegionSlice>* f[4] = {&o.rowwise_data, &o.rowwise_scale_inv,
                                             &o.columnwise_data, &o.columnwise_scale_inv};
    for (int i = 0; i < 4; ++i) {
      if (out[i] != 0) *f[i] = SliceLocked(out[i], p.out_bytes[i]);
    }
    const Clock::time_point t1 = prof ? Clock::now() : Clock::time_point();
    const uint64_t op = Unwrap(ch.Quantize(in, p.config, o));
    if (prof) Account(t0, t1, Clock::now());
    return op;
  }

  // Opt-in timing of the native part of quantize calls (for
  // bench/python_channel_bench.py --breakdown): with it on, each call adds
  // its time from entry (GIL held) to the slices resolved ("lookup_ns": GIL
  // release, lock, channel lookup, region lookups) and from there to the
  // channel's submission done ("submit_ns"), and the channel's own split of
  // the submission (qtx::ChannelSubmitProfile, this thread's). profile()
  // returns and clears.
  void SetProfiling(bool on) {
    std::lock_guard<std::mutex> l(mu_);
    profiling_ = on;
    qtx::SetChannelSubmitProfiling(on);
  }
  // Benchmarks only: RegionCache::set_fast_path.
  void SetRegionFastPath(bool on) {
    std::lock_guard<std::mutex> l(mu_);
    if (cache_) cache_->set_fast_path(on);
  }
  py::dict Profile() {
    py::dict d;
    std::lock_guard<std::mutex> l(mu_);
    d["calls"] = prof_calls_;
    d["lookup_ns"] = prof_lookup_ns_;
    d["submit_ns"] = prof_submit_ns_;
    d["fast_hits"] = cache_ ? cache_->fast_hits() : 0;
    prof_calls_ = prof_lookup_ns_ = prof_submit_ns_ = 0;
    const qtx::ChannelSubmitProfile c = qtx::TakeChannelSubmitProfile();
    d["channel_calls"] = c.calls;
    d["channel_check_ns"] = c.check_ns;
    d["channel_build_ns"] = c.build_ns;
    d["channel_signal_ns"] = c.signal_ns;
    d["channel_enqueue_ns"] = c.enqueue_ns;
    d["channel_wait_ns"] = c.wait_ns;
    return d;
  }

  // Submits this rank's part of AllGather `sequence` of `group`.
  uint64_t AllGather(int device, uintptr_t stream, const std::string& group, uint64_t sequence,
                     int gather_mode, uintptr_t input, int dtype, const std::vector<int64_t>& shape,
                     int mode, int format, bool rowwise, bool columnwise, bool pow2, float eps,
                     const std::vector<Buf>& outs) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> l(mu_);
    qtx::Channel& ch = ChannelLocked(device, stream);
    const qtx::Tensor in = InputTensor(input, dtype, shape);
    const qtx::QuantizeOutputs o = Outputs(outs);
    return Unwrap(ch.AllGather(group, sequence, in,
                               MakeConfig(mode, format, rowwise, columnwise, pow2, eps),
                               static_cast<qtx::AllGatherMode>(gather_mode), o));
  }

  // Submits a dequantization. `bufs`: the four buffers of the quantized
  // tensor (None when absent), `shapes` their shapes (as qtx.cuda.layout
  // gives them: [rows, cols], or [1] for a TENSOR scale; ignored for absent
  // ones).
  uint64_t Dequantize(int device, uintptr_t stream, const std::vector<int64_t>& shape, int mode,
                      int format, const std::vector<Buf>& bufs,
                      const std::vector<std::vector<int64_t>>& shapes, int out_dtype, uintptr_t out,
                      uint64_t out_bytes) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> l(mu_);
    qtx::Channel& ch = ChannelLocked(device, stream);
    qtx::QuantizedTensor q;
    q.shape = shape;
    q.config = MakeConfig(mode, format, bufs[0].has_value(), bufs[2].has_value(), true, 0.0f);
    const qtx::DType fp8 = format == 2 ? qtx::DType::kFloat8E5M2 : qtx::DType::kFloat8E4M3;
    std::optional<qtx::Tensor>* fields[4] = {&q.rowwise_data, &q.rowwise_scale_inv,
                                             &q.columnwise_data, &q.columnwise_scale_inv};
    for (int i = 0; i < 4; ++i) {
      if (!bufs[i]) continue;
      const qtx::RegionSlice s = SliceLocked(bufs[i]->first, bufs[i]->second);
      *fields[i] = qtx::Tensor::InRegion(i % 2 == 0 ? fp8 : qtx::DType::kFloat32, shapes[i], s);
    }
    const qtx::RegionSlice o = SliceLocked(out, out_bytes);
    return Unwrap(ch.Dequantize(q, static_cast<qtx::DType>(out_dtype), o));
  }

  // Query(op) of the channel on (device, stream): True done, False pending,
  // raises the failure.
  bool Query(int device, uintptr_t stream, uint64_t op) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> l(mu_);
    auto it = channels_.find({device, stream});
    if (it == channels_.end()) {
      Throw(absl::InvalidArgumentError(absl::StrFormat(
          "no channel on device %d, stream 0x%x: no call was made there", device, stream)));
    }
    return Unwrap(it->second->Query(op));
  }

  // Synchronize() of every channel; raises the first failure.
  void Synchronize() {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> l(mu_);
    absl::Status first;
    for (auto& [key, ch] : channels_) {
      absl::Status s = ch->Synchronize();
      if (first.ok() && !s.ok()) first = s;
    }
    Check(first);
  }

  void Close() {
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> l(mu_);
      s = CloseLocked();
    }
    Check(s);
  }

  // Channels open now, registrations made by the region cache so far.
  size_t channels() {
    std::lock_guard<std::mutex> l(mu_);
    return channels_.size();
  }
  uint64_t registrations() {
    std::lock_guard<std::mutex> l(mu_);
    return cache_ ? cache_->registrations() : 0;
  }
  uint64_t FastHits() {
    std::lock_guard<std::mutex> l(mu_);
    return cache_ ? cache_->fast_hits() : 0;
  }

  // The region slice of [ptr, ptr + bytes) as (region, offset, size)
  // (registers its allocation on first use).
  py::tuple Slice(int device, uintptr_t ptr, uint64_t bytes) {
    qtx::RegionSlice s;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> l(mu_);
      UseDevice(device);
      s = SliceLocked(ptr, bytes);
    }
    return py::make_tuple(s.region, s.offset, s.size);
  }

  // Synchronous inline Quantize (host bytes in, host bytes out): the C++
  // client's plain call, used by tests against a CPU qtxd as the reference.
  py::dict QuantizeHost(py::bytes data, int dtype, const std::vector<int64_t>& shape, int mode,
                        int format, bool rowwise, bool columnwise, bool pow2, float eps) {
    qtx::Tensor in = qtx::Tensor::Inline(static_cast<qtx::DType>(dtype), shape, std::string(data));
    qtx::QuantizedTensor q;
    {
      py::gil_scoped_release nogil;
      q = Unwrap(client_->Quantize(in, MakeConfig(mode, format, rowwise, columnwise, pow2, eps)));
    }
    py::dict d;
    const std::pair<const char*, const std::optional<qtx::Tensor>*> fields[4] = {
        {"rowwise_data", &q.rowwise_data},
        {"rowwise_scale_inv", &q.rowwise_scale_inv},
        {"columnwise_data", &q.columnwise_data},
        {"columnwise_scale_inv", &q.columnwise_scale_inv}};
    for (const auto& [name, t] : fields) {
      if (*t) d[name] = py::make_tuple(py::bytes((*t)->data), (*t)->shape);
    }
    return d;
  }

  // Client::CreateGroup; returns (rank, world_size, next_sequence).
  py::tuple CreateGroup(const std::string& name, int rank, int world_size,
                        const std::string& coordinator, int backend, double timeout_s) {
    qtx::CollectiveGroupConfig c;
    c.name = name;
    c.rank = rank;
    c.world_size = world_size;
    c.coordinator = coordinator;
    c.backend = static_cast<qtx::CommBackend>(backend);
    c.timeout = absl::Seconds(timeout_s);
    qtx::CollectiveGroupInfo info;
    {
      py::gil_scoped_release nogil;
      qtx::CallOptions call;
      call.timeout = absl::Seconds(timeout_s + 10);
      info = Unwrap(client_->CreateGroup(c, call));
    }
    return py::make_tuple(info.rank, info.world_size, info.next_sequence);
  }

  // Client::OffloadOptimizerState with inline masters: params is a list of
  // (name, float32 bytes, shape). hyper: (lr, beta1, beta2, eps,
  // weight_decay, bias_correction). param_hyper: per parameter (in order),
  // its own (weight_decay, lr_scale), None for the group's. shards: per
  // parameter (in order), its data-parallel range (begin, end) or None; a
  // ranged parameter's shape is the whole one and its bytes the end - begin
  // owned elements. Returns the group's parameter count.
  int OffloadOptimizerState(
      const std::string& group,
      const std::vector<std::tuple<std::string, py::bytes, std::vector<int64_t>>>& params,
      const std::tuple<double, double, double, double, double, bool>& hyper, int mode, int format,
      bool rowwise, bool columnwise, bool pow2, float eps, int64_t step, bool replace,
      const std::vector<std::pair<std::optional<double>, std::optional<double>>>& param_hyper,
      const std::vector<std::optional<std::pair<int64_t, int64_t>>>& shards) {
    qtx::OptimizerGroupConfig c;
    c.group = group;
    std::tie(c.hyper_params.lr, c.hyper_params.beta1, c.hyper_params.beta2, c.hyper_params.eps,
             c.hyper_params.weight_decay, c.hyper_params.bias_correction) = hyper;
    c.output.fp8 = MakeConfig(mode, format, rowwise, columnwise, pow2, eps);
    c.step = step;
    c.replace = replace;
    std::vector<qtx::OptimizerParameterInit> inits;
    for (const auto& [name, bytes, shape] : params) {
      qtx::OptimizerParameterInit p;
      p.name = name;
      p.shape = shape;
      const std::optional<std::pair<int64_t, int64_t>> range =
          inits.size() < shards.size() ? shards[inits.size()] : std::nullopt;
      if (range.has_value()) {
        p.shard = qtx::ShardRange{range->first, range->second};
        p.master = qtx::Tensor::Inline(qtx::DType::kFloat32, {range->second - range->first},
                                       std::string(bytes));
      } else {
        p.master = qtx::Tensor::Inline(qtx::DType::kFloat32, shape, std::string(bytes));
      }
      if (inits.size() < param_hyper.size()) {
        std::tie(p.weight_decay, p.lr_scale) = param_hyper[inits.size()];
      }
      inits.push_back(std::move(p));
    }
    py::gil_scoped_release nogil;
    return Unwrap(client_->OffloadOptimizerState(c, inits)).num_parameters;
  }

  // (name, pointer, dtype, shape) of each gradient in device memory.
  using DeviceGradients =
      std::vector<std::tuple<std::string, uintptr_t, int, std::vector<int64_t>>>;

  // What Step and GradNorm share: `grads` as tensors of registered device
  // memory on `device` (made current), and `call` set to make qtxd wait for
  // the work queued on `stream` so far (device's ready event, recorded now).
  // Fails (FAILED_PRECONDITION) on a closed session. REQUIRES: mu_ held.
  std::vector<qtx::OptimizerGradient> DeviceGradientsLocked(int device, uintptr_t stream,
                                                            const DeviceGradients& grads,
                                                            qtx::CallOptions& call) {
    if (!client_ || !cache_) Throw(absl::FailedPreconditionError("the session is closed"));
    UseDevice(device);
    std::vector<qtx::OptimizerGradient> g;
    for (const auto& [name, ptr, dtype, shape] : grads) {
      if (ptr == 0 && shape == std::vector<int64_t>{0}) {
        // A sharded parameter this owner owns nothing of: an empty inline
        // gradient.
        g.push_back({name, qtx::Tensor::FromFloat32({0}, std::span<const float>())});
        continue;
      }
      g.push_back({name, InputTensor(ptr, dtype, shape)});
    }
    Events& ev = EventsLocked(device);
    CheckCuda(cudaEventRecord(ev.ready->get(), reinterpret_cast<cudaStream_t>(stream)),
              "cudaEventRecord");
    call.cuda_wait_event = ev.ready->handle();
    return g;
  }

  // Client::Step with gradients in device memory and FP8 destinations in
  // device memory, ordered on `stream` by interprocess events: qtxd waits
  // for an event recorded on `stream` now (the gradients are written), and
  // `stream` waits for qtxd's event after the outputs are written. The host
  // returns when qtxd answers (it has read the gradients: the statistics
  // need them). grads: (name, ptr, dtype, shape); dests: (name, 4 buffers).
  // lr < 0 / max_grad_norm <= 0: not set; clip_factor / skip: the caller's
  // decisions of a two-phase step (sent as given: qtxd checks them).
  // collective_group (empty: none) / sequence: a data-parallel sharded
  // group's collective Step. Returns the statistics as a dict.
  py::dict Step(int device, uintptr_t stream, const std::string& group, int64_t step,
                const DeviceGradients& grads,
                const std::vector<std::pair<std::string, std::vector<Buf>>>& dests, double lr,
                double max_grad_norm, bool skip_if_non_finite, std::optional<double> clip_factor,
                bool skip, const std::string& collective_group, uint64_t sequence) {
    qtx::OptimizerStepResult r;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> l(mu_);
      qtx::CallOptions call;
      const std::vector<qtx::OptimizerGradient> g =
          DeviceGradientsLocked(device, stream, grads, call);
      qtx::StepOptions o;
      if (lr >= 0) o.lr = lr;
      if (max_grad_norm > 0) o.max_grad_norm = max_grad_norm;
      o.skip_if_non_finite = skip_if_non_finite;
      o.clip_factor = clip_factor;
      o.skip = skip;
      o.collective_group = collective_group;
      o.sequence = sequence;
      for (const auto& [name, bufs] : dests) {
        qtx::ParameterDestination d;
        d.name = name;
        d.fp8 = Outputs(bufs);
        o.destinations.push_back(std::move(d));
      }
      Events& ev = EventsLocked(device);
      call.cuda_signal_event = ev.done->handle();
      r = Unwrap(client_->Step(group, step, g, o, call));
      CheckCuda(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), ev.done->get(), 0),
                "cudaStreamWaitEvent");
    }
    py::dict d;
    d["step"] = r.stats.step;
    d["grad_norm"] = r.stats.grad_norm;
    d["skipped"] = r.stats.skipped;
    d["non_finite"] = r.stats.non_finite;
    d["clip_coef"] = r.stats.clip_coef;
    d["lr"] = r.stats.lr;
    d["replayed"] = r.stats.replayed;
    return d;
  }

  // Client::GradNorm with gradients in device memory, ordered on `stream`:
  // qtxd reads them after the work queued on `stream` so far; the host
  // returns with qtxd's answer (every gradient was read by then). Returns
  // {step, sum_squares, non_finite, grad_norm, step_processed}.
  py::dict GradNorm(int device, uintptr_t stream, const std::string& group, int64_t step,
                    const DeviceGradients& grads) {
    qtx::GradNormResult r;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> l(mu_);
      qtx::CallOptions call;
      const std::vector<qtx::OptimizerGradient> g =
          DeviceGradientsLocked(device, stream, grads, call);
      r = Unwrap(client_->GradNorm(group, step, g, {}, call));
    }
    py::dict d;
    d["step"] = r.step;
    d["sum_squares"] = r.sum_squares;
    d["non_finite"] = r.non_finite;
    d["grad_norm"] = r.grad_norm;
    d["step_processed"] = r.step_processed;
    return d;
  }

  // Client::Step with inline gradients (host bytes) and inline outputs: the
  // reference path for tests against a CPU qtxd. Returns
  // {name: {field: bytes}}.
  py::dict StepHost(
      const std::string& group, int64_t step,
      const std::vector<std::tuple<std::string, py::bytes, int, std::vector<int64_t>>>& grads) {
    std::vector<qtx::OptimizerGradient> g;
    for (const auto& [name, bytes, dtype, shape] : grads) {
      g.push_back(
          {name, qtx::Tensor::Inline(static_cast<qtx::DType>(dtype), shape, std::string(bytes))});
    }
    qtx::OptimizerStepResult r;
    {
      py::gil_scoped_release nogil;
      r = Unwrap(client_->Step(group, step, g));
    }
    py::dict out;
    for (const auto& p : r.parameters) {
      py::dict f;
      if (p.fp8) {
        const std::pair<const char*, const std::optional<qtx::Tensor>*> fields[4] = {
            {"rowwise_data", &p.fp8->rowwise_data},
            {"rowwise_scale_inv", &p.fp8->rowwise_scale_inv},
            {"columnwise_data", &p.fp8->columnwise_data},
            {"columnwise_scale_inv", &p.fp8->columnwise_scale_inv}};
        for (const auto& [name, t] : fields) {
          if (*t) f[name] = py::bytes((*t)->data);
        }
      }
      out[py::str(p.name)] = f;
    }
    return out;
  }

  void DestroyGroup(const std::string& name) {
    py::gil_scoped_release nogil;
    Check(client_->DestroyGroup(name));
  }

 private:
  qtx::Tensor InputTensor(uintptr_t ptr, int dtype, const std::vector<int64_t>& shape) {
    const auto d = static_cast<qtx::DType>(dtype);
    const int64_t n = Unwrap(qtx::NumElements(shape));
    return qtx::Tensor::InRegion(
        d, shape,
        SliceLocked(ptr, static_cast<uint64_t>(n) * static_cast<uint64_t>(qtx::DTypeSize(d))));
  }
  qtx::QuantizeOutputs Outputs(const std::vector<Buf>& outs) {
    if (outs.size() != 4) {
      Throw(
          absl::InvalidArgumentError("outputs: 4 entries (rowwise data/scale, columnwise "
                                     "data/scale), None for those not requested"));
    }
    qtx::QuantizeOutputs o;
    std::optional<qtx::RegionSlice>* f[4] = {&o.rowwise_data, &o.rowwise_scale_inv,
                                             &o.columnwise_data, &o.columnwise_scale_inv};
    for (int i = 0; i < 4; ++i) {
      if (outs[i]) *f[i] = SliceLocked(outs[i]->first, outs[i]->second);
    }
    return o;
  }
  qtx::RegionSlice SliceLocked(uintptr_t ptr, uint64_t bytes) {
    if (!cache_) Throw(absl::FailedPreconditionError("the session is closed"));
    return Unwrap(cache_->Slice(reinterpret_cast<const void*>(ptr), bytes));
  }
  qtx::Channel& ChannelLocked(int device, uintptr_t stream) {
    if (!client_ || !cache_) Throw(absl::FailedPreconditionError("the session is closed"));
    UseDevice(device);
    auto it = channels_.find({device, stream});
    if (it != channels_.end()) return *it->second;
    qtx::ChannelOptions opts;
    opts.label = absl::StrFormat("%s/cuda:%d/0x%x", label_, device, stream);
    opts.background_writer = background_writer_;
    std::unique_ptr<qtx::Channel> ch = Unwrap(
        qtx::cuda::OpenChannel(*client_, reinterpret_cast<cudaStream_t>(stream), opts, flags_));
    return *channels_.emplace(std::make_pair(device, stream), std::move(ch)).first->second;
  }
  struct Events {
    std::optional<qtx::cuda::IpcEvent> ready, done;
  };
  Events& EventsLocked(int device) {
    Events& e = events_[device];
    if (!e.ready) {
      e.ready.emplace(Unwrap(qtx::cuda::IpcEvent::Create()));
      e.done.emplace(Unwrap(qtx::cuda::IpcEvent::Create()));
    }
    return e;
  }
  absl::Status CloseLocked() {
    absl::Status first;
    for (auto& [key, ch] : channels_) {
      absl::Status s = ch->Close();
      if (first.ok() && !s.ok()) first = s;
    }
    channels_.clear();
    events_.clear();
    cache_.reset();  // unregisters what it registered
    return first;
  }

  using Clock = std::chrono::steady_clock;
  // REQUIRES: mu_ held.
  void Account(Clock::time_point t0, Clock::time_point t1, Clock::time_point t2) {
    ++prof_calls_;
    prof_lookup_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
    prof_submit_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(t2 - t1).count();
  }

  struct Plan {
    qtx::DType dtype = qtx::DType::kFloat32;
    std::vector<int64_t> shape;
    uint64_t input_bytes = 0;
    qtx::QuantizeConfig config;
    std::array<uint64_t, 4> out_bytes{};
  };

  const std::string label_;
  const bool background_writer_;
  std::vector<Plan> plans_;  // mu_ (QuantizePlan appends; entries never change)
  std::atomic<bool> profiling_{false};
  uint64_t prof_calls_ = 0, prof_lookup_ns_ = 0, prof_submit_ns_ = 0;  // mu_
  qtx::cuda::FlagMemory flags_ = qtx::cuda::FlagMemory::kHostShm;
  std::mutex mu_;
  std::unique_ptr<qtx::Client> client_;
  std::unique_ptr<qtx::cuda::RegionCache> cache_;                                // guarded by mu_
  std::map<std::pair<int, uintptr_t>, std::unique_ptr<qtx::Channel>> channels_;  // mu_
  std::map<int, Events> events_;  // mu_: Step's interprocess events per device
};

// ---- DLPack (dlpack.h v0.8 ABI, the layout every framework exchanges) -------------------------
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// The fields of a "dltensor" capsule, without consuming it: (pointer incl.
// byte_offset, shape, strides in elements or None, (code, bits, lanes),
// (device_type, device_id)).
py::tuple ParseDlpack(py::capsule capsule) {
  if (std::string(capsule.name() ? capsule.name() : "") != "dltensor") {
    Throw(absl::InvalidArgumentError(
        absl::StrFormat("DLPack capsule named '%s': expected an unconsumed 'dltensor'",
                        capsule.name() ? capsule.name() : "")));
  }
  auto* m = static_cast<DLManagedTensor*>(capsule.get_pointer());
  if (m == nullptr) Throw(absl::InvalidArgumentError("DLPack capsule holds no tensor"));
  const DLTensor& t = m->dl_tensor;
  std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
  py::object strides = py::none();
  if (t.strides != nullptr) strides = py::cast(std::vector<int64_t>(t.strides, t.strides + t.ndim));
  const uintptr_t ptr = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
  return py::make_tuple(ptr, shape, strides,
                        py::make_tuple(t.dtype.code, t.dtype.bits, t.dtype.lanes),
                        py::make_tuple(t.device.device_type, t.device.device_id));
}

// ---- CUDA helpers for the pool and async handles (all on `device`) -----------------------------
uintptr_t Malloc(int device, uint64_t bytes) {
  UseDevice(device);
  void* p = nullptr;
  CheckCuda(cudaMalloc(&p, bytes), "cudaMalloc");
  return reinterpret_cast<uintptr_t>(p);
}
// qtx::cuda::MakeColumnwiseCopy on `stream` (docs/numerics.md §4.5); the
// pointers are device pointers sized per layout(shape, mode).
void MakeColumnwise(int device, uintptr_t stream, int mode, const std::vector<int64_t>& shape,
                    uintptr_t rowwise_data, uintptr_t rowwise_scale_inv, uintptr_t columnwise_data,
                    uintptr_t columnwise_scale_inv) {
  UseDevice(device);
  const absl::Status s = qtx::cuda::MakeColumnwiseCopy(
      static_cast<qtx::ScalingMode>(mode), shape,
      {reinterpret_cast<const void*>(rowwise_data),
       reinterpret_cast<const float*>(rowwise_scale_inv)},
      {reinterpret_cast<void*>(columnwise_data), reinterpret_cast<float*>(columnwise_scale_inv)},
      reinterpret_cast<cudaStream_t>(stream));
  if (!s.ok()) Throw(s);
}
void Free(int device, uintptr_t ptr) {
  UseDevice(device);
  CheckCuda(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}
uintptr_t EventRecord(int device, uintptr_t stream) {
  UseDevice(device);
  cudaEvent_t e = nullptr;
  CheckCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  const cudaError_t err = cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    (void)cudaEventDestroy(e);
    CheckCuda(err, "cudaEventRecord");
  }
  return reinterpret_cast<uintptr_t>(e);
}
bool EventQuery(uintptr_t event) {
  const cudaError_t e = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) return false;
  CheckCuda(e, "cudaEventQuery");
  return true;
}
void EventSynchronize(uintptr_t event) {
  cudaError_t e;
  {
    py::gil_scoped_release nogil;
    e = cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event));
  }
  CheckCuda(e, "cudaEventSynchronize");
}
void EventDestroy(uintptr_t event) { (void)cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)); }
void StreamWaitEvent(int device, uintptr_t stream, uintptr_t event) {
  UseDevice(device);
  CheckCuda(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                reinterpret_cast<cudaEvent_t>(event), 0),
            "cudaStreamWaitEvent");
}
// The device a pointer lives on, -1 for host / unknown memory.
int PointerDevice(uintptr_t ptr) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(ptr)) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

// The Python exception of a failed status (the class qtx.errors.from_status
// gives), set as the current error.
void SetStatusError(const StatusException& e) {
  py::object errors = py::module_::import("qtx.errors");
  py::object exc = errors.attr("from_status")(e.code, e.message);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

// submit_quantize(session, plan, device, stream, input, rowwise_data,
// rowwise_scale_inv, columnwise_data, columnwise_scale_inv) -> op: the
// fast path's one call per quantize (qtx.cuda checked everything it can
// beforehand). A plain METH_FASTCALL function: nine ints in, no pybind11
// overload dispatch, no argument lists built.
PyObject* SubmitQuantizeFast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_Format(PyExc_TypeError, "submit_quantize takes 9 arguments (%zd given)", nargs);
    return nullptr;
  }
  NativeSession* session = nullptr;
  try {
    session = py::handle(args[0]).cast<NativeSession*>();
  } catch (const py::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "submit_quantize: argument 1 must be a qtx._native.Session");
    return nullptr;
  }
  const long plan = PyLong_AsLong(args[1]);
  const long device = PyLong_AsLong(args[2]);
  uintptr_t v[6];
  for (int i = 0; i < 6; ++i) v[i] = PyLong_AsUnsignedLongLong(args[3 + i]);
  if (PyErr_Occurred()) return nullptr;
  try {
    const uint64_t op = session->SubmitQuantize(static_cast<int>(plan), static_cast<int>(device),
                                                v[0], v[1], v + 2);
    return PyLong_FromUnsignedLongLong(op);
  } catch (const StatusException& e) {
    SetStatusError(e);
  } catch (const py::error_already_set& e) {
    py::error_already_set(e).restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef kFastFunctions[] = {
    {"submit_quantize",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&SubmitQuantizeFast)),
     METH_FASTCALL, "submit_quantize(session, plan, device, stream, input, rd, rs, cd, cs) -> op"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "qtx._native: the compiled core of qtx.cuda (see qtx/cuda.py)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      SetStatusError(e);
    }
  });

  py::class_<NativeSession>(m, "Session")
      .def(py::init<const std::string&, const std::string&, const std::string&, double, bool>(),
           py::arg("target"), py::arg("flag_memory") = "host", py::arg("label") = "py",
           py::arg("timeout") = 60.0, py::arg("background_writer") = false)
      .def("quantize_plan", &NativeSession::QuantizePlan)
      .def("health", &NativeSession::Health)
      .def("wait_until_serving", &NativeSession::WaitUntilServing, py::arg("timeout"))
      .def("quantize", &NativeSession::Quantize)
      .def("quantize_into", &NativeSession::QuantizeInto)
      .def("set_profiling", &NativeSession::SetProfiling)
      .def("profile", &NativeSession::Profile)
      .def("set_region_fast_path", &NativeSession::SetRegionFastPath)
      .def("fast_hits", [](NativeSession& s) { return s.FastHits(); })
      .def("all_gather", &NativeSession::AllGather)
      .def("dequantize", &NativeSession::Dequantize)
      // No qtxd call: the session only gives qtx.cuda one place to call it
      // through (and the tests one place to stand in for it).
      .def(
          "make_columnwise",
          [](NativeSession&, int device, uintptr_t stream, int mode,
             const std::vector<int64_t>& shape, uintptr_t rowwise_data, uintptr_t rowwise_scale_inv,
             uintptr_t columnwise_data, uintptr_t columnwise_scale_inv) {
            MakeColumnwise(device, stream, mode, shape, rowwise_data, rowwise_scale_inv,
                           columnwise_data, columnwise_scale_inv);
          })
      .def("query", &NativeSession::Query)
      .def("synchronize", &NativeSession::Synchronize)
      .def("close", &NativeSession::Close)
      .def("channels", &NativeSession::channels)
      .def("registrations", &NativeSession::registrations)
      .def("slice", &NativeSession::Slice)
      .def("quantize_host", &NativeSession::QuantizeHost)
      .def("create_group", &NativeSession::CreateGroup)
      .def("destroy_group", &NativeSession::DestroyGroup)
      .def("offload_optimizer_state", &NativeSession::OffloadOptimizerState)
      .def("step", &NativeSession::Step)
      .def("grad_norm", &NativeSession::GradNorm)
      .def("step_host", &NativeSession::StepHost);

  if (PyModule_AddFunctions(m.ptr(), kFastFunctions) != 0) throw py::error_already_set();
  m.def("parse_dlpack", &ParseDlpack, "Fields of an unconsumed 'dltensor' capsule.");
  m.def("malloc", &Malloc);
  m.def("free", &Free);
  m.def("event_record", &EventRecord);
  m.def("event_query", &EventQuery);
  m.def("event_synchronize", &EventSynchronize);
  m.def("event_destroy", &EventDestroy);
  m.def("stream_wait_event", &StreamWaitEvent);
  m.def("pointer_device", &PointerDevice);
  // {field: shape} of quantizing `shape` with `mode`: 2-D (rows, cols) for
  // the data and the block scales; TENSOR's scale_inv is (1,), the [1] of
  // docs/numerics.md §9 (QuantizedLayout counts it as one 1x1 buffer).
  m.def("layout", [](int mode, const std::vector<int64_t>& shape) {
    const auto scaling = static_cast<qtx::ScalingMode>(mode);
    const qtx::QuantizedLayout l = Unwrap(qtx::ComputeQuantizedLayout(scaling, shape));
    const auto scale_shape = [scaling](int64_t rows, int64_t cols) {
      return scaling == qtx::ScalingMode::kTensor ? py::make_tuple(rows * cols)
                                                  : py::make_tuple(rows, cols);
    };
    py::dict d;
    d["m"] = l.m;
    d["n"] = l.n;
    d["rowwise_data"] = py::make_tuple(l.rowwise_data_rows, l.rowwise_data_cols);
    d["rowwise_scale_inv"] = scale_shape(l.rowwise_scale_rows, l.rowwise_scale_cols);
    d["columnwise_data"] = py::make_tuple(l.columnwise_data_rows, l.columnwise_data_cols);
    d["columnwise_scale_inv"] = scale_shape(l.columnwise_scale_rows, l.columnwise_scale_cols);
    return d;
  });
}

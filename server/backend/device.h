// Device: where quantization runs. The ops see only this interface;
// CpuDevice (kernels/cpu) is always built, a CudaDevice (kernels/cuda) joins
// when the CUDA backend exists.
//
// Memory: every pointer a Device method takes lives in the device's memory
// kind (memory_kind()): host memory for CpuDevice, device memory for a CUDA
// device. Callers move host bytes in and out with Allocate/CopyFromHost/
// CopyToHost, so an op works unchanged on either device.
//
// Thread safety: implementations are safe for concurrent use by several
// request threads.
#ifndef QTX_SERVER_BACKEND_DEVICE_H_
#define QTX_SERVER_BACKEND_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/block_geometry.h"
#include "kernels/quantize_params.h"
#include "kernels/shard_geometry.h"
#include "server/tensor/mapped_memory.h"

namespace qtx::server::backend {

// Memory owned by a Device; freed when destroyed. Movable, not copyable.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* data, uint64_t size, std::function<void(void*)> free)
      : data_(data), size_(size), free_(std::move(free)) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        free_(std::move(o.free_)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      free_ = std::move(o.free_);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void Reset() {
    if (data_ != nullptr && free_) free_(data_);
    data_ = nullptr;
    size_ = 0;
  }
  void* data_ = nullptr;
  uint64_t size_ = 0;
  std::function<void(void*)> free_;
};

// Interprocess CUDA events that order one call against the client's GPU
// work without a host round trip: each is a 64-byte cudaIpcEventHandle_t the
// client exported (cudaEventInterprocess | cudaEventDisableTiming); empty
// means none. Only a device whose memory_kind() is kDevice accepts them
// (server/ops rejects them otherwise, before any work).
class ChannelQueue;

struct CudaEvents {
  std::string wait_event;    // waited on before the inputs are read
  std::string signal_event;  // recorded once the outputs are written
  // A stream-ordered channel's queue (server/ops/channel.h) for an op made of
  // several device steps (AllGather): OrderAfterClient orders this thread's
  // stream after the work enqueued on the queue so far, SignalClient orders
  // the queue after this thread's stream. Stream-ordered, no host wait.
  ChannelQueue* queue = nullptr;
  // No interprocess event handles (a queue may still be set).
  bool empty() const { return wait_event.empty() && signal_event.empty(); }
};

// The device side of one stream-ordered channel (proto/qtx/v1/channel.proto):
// an in-order queue of device work bound to the client's 16-byte flag area
// (ready word at +0, done word at +8, in the device's memory kind). The
// channel (server/ops/channel.h) enqueues, per operation n,
// WaitReady(n) -> the op (QuantizeArgs::queue / DequantizeArgs::queue set to
// this queue) -> WriteDone(n). Nothing here blocks the calling thread on
// device work, except on a device without streams (CPU), where the queue is
// the calling thread itself and WaitReady blocks until the word is reached.
//
// One caller at a time (the channel's worker thread) for the enqueue
// methods; OnDrained callbacks run on a thread of the queue, in order.
// Destroying the queue waits for the work already enqueued.
class ChannelQueue {
 public:
  virtual ~ChannelQueue() = default;

  // Enqueues "wait until the ready word has reached seq", compared as
  // CU_STREAM_WAIT_VALUE_GEQ does: (int64_t)(ready - seq) >= 0.
  virtual absl::Status WaitReady(uint64_t seq) = 0;
  // Enqueues "done word = value" after everything enqueued before it. The
  // write is ordered after the writes of the work before it (a memory fence
  // of the queue's scope precedes it), so a waiter released by it sees the
  // outputs.
  virtual absl::Status WriteDone(uint64_t value) = 0;
  // Runs `drained` once everything enqueued so far has finished on the
  // device. In enqueue order; never on the calling thread of a streamed device.
  virtual absl::Status OnDrained(std::function<void()> drained) = 0;
  // The client is gone (or stopped) and its ready word will not move:
  // releases every present and future WaitReady of this queue, so the work
  // behind them runs and the queue drains (its regions are still mapped: the
  // channel pins them until the work completes). A streamed device cannot
  // take back enqueued work, and leaving a stream parked for good would hang
  // every later device-wide synchronization of the process. Stores the
  // release value at every call (a client stream still running may write its
  // own ready values over it: call again until the queue has drained). Safe
  // to call from any thread.
  virtual void Release() = 0;
  // The client's process is gone: stores `value` into the done word from the
  // host, at once (not in queue order), so that the waits for "done" its
  // dead process left queued on its own stream pass. A killed process whose
  // stream is parked on hundreds of such waits kept the queues of qtxd from
  // running until they passed (H200, driver 580, no MPS;
  // tests/client/cuda/cuda_vmm_test.cc, KillBusyClient*). Safe to call from
  // any thread.
  virtual void ReleaseClientWaits(uint64_t value) = 0;
  // One line for a log when the queue does not drain: what the host can see
  // of it without touching the device (the flag words when they are host
  // memory, the completions still awaited). Safe to call from any thread.
  virtual std::string DescribeState() = 0;
};

// One quantization of a row-major [m, n] tensor (docs/numerics.md §2-§4).
struct QuantizeArgs {
  const void* input = nullptr;  // m * n elements of `dtype`; null iff empty
  kernels::InputDType dtype = kernels::InputDType::kFloat32;
  int64_t m = 0;
  int64_t n = 0;
  kernels::QuantizeParams params;
  kernels::QuantizedBuffers out;  // sized per kernels::ComputeLayout
  CudaEvents events;
  // Set: enqueue on the channel queue and return at once (events empty).
  ChannelQueue* queue = nullptr;
};

// One dequantization of a quantized [m, n] tensor.
struct DequantizeArgs {
  kernels::QuantizedConstBuffers in;  // the chosen copy's buffers
  kernels::BlockScaling scaling = kernels::BlockScaling::kBlock1D;
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  int64_t m = 0;
  int64_t n = 0;
  bool use_rowwise = true;
  kernels::InputDType out_dtype = kernels::InputDType::kFloat32;
  void* out = nullptr;  // m * n elements of out_dtype
  CudaEvents events;
  ChannelQueue* queue = nullptr;  // as QuantizeArgs::queue
};

// One rank's shard of the exact all-gather (docs/numerics.md §5): rows
// [geom.row_offset, geom.row_offset + geom.m) of the global [M, N] tensor.
struct ShardArgs {
  const void* input = nullptr;  // geom.m * geom.n elements of `dtype`
  kernels::InputDType dtype = kernels::InputDType::kFloat32;
  kernels::ShardGeometry geom;
  kernels::QuantizeParams params;
};

// The one-round AllGather's slot check (server/ops/allgather.cc), done by the
// device in stream order so that a stream-ordered call never waits for it:
// `count` records of `header_bytes` bytes, record r at slots + r *
// slot_stride. Record r passes when its first `agreed_bytes` bytes equal
// `expected`'s, the int32 at `rank_offset` is r and the int32 at
// `status_offset` is 0. Every record is copied to headers_out + r *
// header_bytes (for the host to explain a failure), and *bad is set to 0
// when every record passes, to a nonzero value otherwise. `expected`, `headers_out` and `bad` are
// host-visible memory (Device::AllocateHostVisible), `slots` device memory.
struct SlotHeaderCheck {
  const void* slots = nullptr;
  uint64_t slot_stride = 0;
  int count = 0;
  const void* expected = nullptr;
  uint32_t header_bytes = 0;
  uint32_t agreed_bytes = 0;  // <= rank_offset, status_offset; a multiple of 4
  uint32_t rank_offset = 0;
  uint32_t status_offset = 0;
  void* headers_out = nullptr;
  uint32_t* bad = nullptr;
};

// Asynchronous copies between device memory and page-locked host staging that
// the pipeline owns, for an op that overlaps host work with transfers (the
// optimizer step: parameter i+1's gradient travels to the host while the host
// steps parameter i and parameter i-1's outputs travel back). Two in-order
// queues run concurrently with each other and with the host: the inbound queue
// (device -> host) and the outbound queue (host -> device).
//
// Kept across calls so that its staging is allocated once. One call at a time:
// Begin, copies, Finish (or Drain on an error path). Not safe for concurrent
// use. Destroying it waits for its queued copies, then frees the staging.
class TransferPipeline {
 public:
  virtual ~TransferPipeline() = default;

  // Page-locked host memory of at least `bytes` owned by the pipeline; grows
  // (contents lost) only when it is smaller. Drains queued copies first.
  // RESOURCE_EXHAUSTED when it cannot be allocated.
  virtual absl::StatusOr<std::byte*> Staging(uint64_t bytes) = 0;
  virtual uint64_t staging_bytes() const = 0;

  // Starts a call: waits (host) until every copy of the previous call is done,
  // then makes both queues wait on events.wait_event (when set) before their
  // first copy. Opens events.signal_event too, so that a bad handle fails here,
  // before any copy. INVALID_ARGUMENT for a handle that cannot be opened.
  virtual absl::Status Begin(const CudaEvents& events) = 0;

  // Enqueues a device -> host copy on the inbound queue and returns its ticket
  // (0, 1, 2, ... within a call). `host_dst` lies in the staging.
  virtual absl::StatusOr<int> CopyToHostAsync(void* host_dst, const void* device_src,
                                              uint64_t bytes) = 0;
  // Blocks until the inbound copy `ticket` (and every one before it) is done.
  virtual absl::Status WaitInbound(int ticket) = 0;

  // Enqueues a host -> device copy on the outbound queue. `host_src` lies in
  // the staging and must not change until the copy is done.
  virtual absl::Status CopyFromHostAsync(void* device_dst, const void* host_src,
                                         uint64_t bytes) = 0;

  // Ends the call. With events.signal_event set: records it on the outbound
  // queue after every copy and returns at once (the next Begin or Staging
  // waits for the copies before the staging is reused). Without one: returns
  // when every outbound copy is done.
  virtual absl::Status Finish() = 0;

  // Blocks until every queued copy is done (for error paths).
  virtual absl::Status Drain() = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  // "cpu", "cuda:0", ...
  virtual std::string name() const = 0;

  // The memory the kernels of this device read and write.
  virtual tensor::MemoryKind memory_kind() const = 0;

  // Allocates `bytes` of device memory (contents unspecified).
  // RESOURCE_EXHAUSTED when the memory is used up.
  virtual absl::StatusOr<DeviceBuffer> Allocate(uint64_t bytes) = 0;

  // Host memory the device's kernels and copies can also read and write
  // (CUDA: mapped page-locked memory, the same address on both sides): for
  // small values the host reads once the device work that wrote them has
  // completed, without a copy. Zero-filled. Returned to the device in stream
  // order (a device with streams: after the work enqueued on this thread's
  // stream when the buffer dies), so a buffer may die before that work ran.
  // The default is plain host memory (a device that computes on host memory).
  virtual absl::StatusOr<DeviceBuffer> AllocateHostVisible(uint64_t bytes);

  // Copies between host and device memory. Returns when the copy is done.
  // REQUIRES: the ranges do not overlap.
  virtual absl::Status CopyFromHost(void* device_dst, const void* host_src, uint64_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src, uint64_t bytes) = 0;

  // Quantizes per `args`; returns when the outputs are written, except that
  // with args.events.signal_event or args.queue set a device may return once
  // the work is enqueued (the event, or the queue, then marks completion). A device waits on
  // args.events.wait_event before it reads the input. Input and outputs must
  // not overlap.
  // REQUIRES: args validated by the caller (server/ops): m, n >= 0, buffers of
  // the requested copies non-null (unless empty) and sized per ComputeLayout,
  // amax_epsilon finite and >= 0. INTERNAL on a device failure.
  virtual absl::Status Quantize(const QuantizeArgs& args) = 0;

  // Dequantizes per `args`; returns when the output is written (events as
  // for Quantize).
  // REQUIRES: as Quantize, for the chosen copy.
  virtual absl::Status Dequantize(const DequantizeArgs& args) = 0;

  // A new transfer pipeline between this device's memory and host staging
  // (see TransferPipeline). FAILED_PRECONDITION on a device whose memory is
  // host memory (the default): there is nothing to transfer.
  virtual absl::StatusOr<std::unique_ptr<TransferPipeline>> CreateTransferPipeline() {
    return absl::FailedPreconditionError("device '" + name() +
                                         "' computes on host memory: it has no transfer pipeline");
  }

  // The queue of a stream-ordered channel whose 16-byte flag area starts at
  // `flags` (8-byte aligned, of memory kind `flags_kind`, pinned by the
  // caller for the queue's life).
  // FAILED_PRECONDITION on a device without channels (the default) or for a
  // memory kind the device cannot order on; INTERNAL on a device failure.
  virtual absl::StatusOr<std::unique_ptr<ChannelQueue>> OpenChannelQueue(
      std::byte* flags, tensor::MemoryKind flags_kind) {
    (void)flags;
    (void)flags_kind;
    return absl::FailedPreconditionError("device '" + name() +
                                         "' does not run stream-ordered channels");
  }

  // Opens device memory another process exported (CUDA IPC) for the region
  // table; null when this device cannot use such memory (the default).
  virtual tensor::CudaIpcOpener cuda_ipc_opener() { return nullptr; }
  // Imports cuMemCreate chunks from POSIX fd handles (cuda_vmm regions);
  // null when this device cannot use such memory (the default).
  virtual tensor::CudaVmmOpener cuda_vmm_opener() { return nullptr; }
  // Maps a GPU UUID to this process's ordinal for the region table; null
  // when this device cannot use CUDA IPC memory (the default).
  virtual tensor::CudaUuidResolver cuda_uuid_resolver() { return nullptr; }

  // ---- Exact all-gather building blocks (kernels/cpu/quantize_shard.h) ----
  // All pointers are device memory. ShardBoundaryAmax and QuantizeShard are
  // stream-ordered: a device with streams (CUDA) may return once the work is
  // enqueued on the calling thread's stream, so that later work of the same
  // thread (copies, AssembleShards, the device communicator's calls, whose
  // default stream is that one) sees the outputs. SynchronizeThisThread waits
  // for all of it.

  // Partial amaxes of the shard's first and last block rows, each
  // kernels::BoundaryAmaxLength(params.scaling, geom) floats.
  virtual absl::Status ShardBoundaryAmax(const ShardArgs& args, float* first, float* last) = 0;

  // Quantizes the shard into the shard layout (kernels/shard_geometry.h) with
  // the combined boundary amaxes `first_amax` / `last_amax`.
  virtual absl::Status QuantizeShard(const ShardArgs& args, const float* first_amax,
                                     const float* last_amax,
                                     const kernels::QuantizedBuffers& out) = 0;

  // Combines the gathered partial boundary amaxes into this rank's
  // (kernels::cpu::CombineBoundaryAmax, bit-exact): `gathered` holds, per
  // rank r in rank order, r's first then last vector of `len` floats
  // (device memory, [world_size][2][len]); `first_out` / `last_out` get len
  // floats each. Stream-ordered like QuantizeShard: a device with streams
  // reads `gathered` after the work enqueued on this thread's stream so far
  // (the communicator's gather into it) and returns once enqueued, so the
  // host never sees the amaxes. The default copies through the host (right
  // for host memory; a device with streams overrides it).
  // REQUIRES: geoms has world_size entries; len = BoundaryAmaxLength of
  // this rank's geometry.
  virtual absl::Status CombineBoundaryAmax(int world_size, const kernels::ShardGeometry* geoms,
                                           const float* gathered, int64_t len, int rank,
                                           kernels::BlockScaling scaling, float* first_out,
                                           float* last_out);

  // As CombineBoundaryAmax, from partial amaxes the host already holds
  // (`firsts[r]` / `lasts[r]`: rank r's vectors of `len` floats in host
  // memory, e.g. exchanged with the AllGather headers): combines them on the
  // host and copies the results to `first_out` / `last_out` (device memory).
  // When this rank's shard is empty (geoms[rank].m == 0) the outputs are
  // zeroed and `firsts` / `lasts` are not read.
  absl::Status CombineHostBoundaryAmax(int world_size, const kernels::ShardGeometry* geoms,
                                       const float* const* firsts, const float* const* lasts,
                                       int64_t len, int rank, kernels::BlockScaling scaling,
                                       float* first_out, float* last_out);

  // Writes the GEMM-ready [sum m, N] tensor from every rank's shard buffers.
  // Stream-ordered like QuantizeShard (a device with streams may return once
  // enqueued: call SynchronizeThisThread to wait for the outputs).
  // REQUIRES: geoms/shards have `world_size` entries (host arrays of device
  // pointers); out sized per kernels::ComputeLayout.
  virtual absl::Status AssembleShards(int world_size, const kernels::ShardGeometry* geoms,
                                      const kernels::QuantizedConstBuffers* shards,
                                      const kernels::QuantizeParams& params,
                                      const kernels::QuantizedBuffers& out) = 0;

  // Copies `bytes` between two buffers of this device's memory, ordered like
  // QuantizeShard on the calling thread's stream (a device with streams may
  // return once it is enqueued). The default is a plain memcpy on a device
  // that computes on host memory; FAILED_PRECONDITION on any other device
  // that does not override it.
  // `src` may also be host-visible memory (AllocateHostVisible).
  // REQUIRES: the ranges do not overlap.
  virtual absl::Status CopyOnDevice(void* dst, const void* src, uint64_t bytes);

  // Enqueues the slot check of `args` (SlotHeaderCheck) on this thread's
  // stream, after the work enqueued there so far (the gather into the
  // slots); a device with streams returns at once, the host reads *bad and
  // the copies once that work has completed. The default runs it on the
  // host (a device that computes on host memory).
  virtual absl::Status CheckSlotHeaders(const SlotHeaderCheck& args);

  // Returns once everything this thread enqueued on its stream is done (a
  // device without streams: at once, the work is already done).
  virtual absl::Status SynchronizeThisThread() { return absl::OkStatus(); }

  // Interprocess-event ordering of an op made of several device steps
  // (AllGather). OrderAfterClient opens both events (a bad handle fails
  // before anything is enqueued) and makes this thread's stream wait for
  // events.wait_event; SignalClient records events.signal_event on that stream
  // once everything enqueued so far is done. A device without streams takes
  // only empty events (FAILED_PRECONDITION otherwise; server/ops checks first).
  virtual absl::Status OrderAfterClient(const CudaEvents& events) { return NoEvents(events); }
  virtual absl::Status SignalClient(const CudaEvents& events) { return NoEvents(events); }

 private:
  static absl::Status NoEvents(const CudaEvents& events) {
    if (events.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        "cuda_events: interprocess CUDA events need a CUDA device (start qtxd with "
        "--device=cuda:N)");
  }
};

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_DEVICE_H_

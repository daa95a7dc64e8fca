// DESIGN note, AllGatherV: the exact all-gather moves shards of different
// sizes (M_r need not be equal, and may be 0). Two ways with NCCL: pad every
// contribution to the largest and run one ncclAllGather (extra bytes on the
// wire plus a compaction copy on every rank), or run one ncclBroadcast per
// rank inside ncclGroupStart/End, each received directly at the rank's
// offset. qtx uses the grouped broadcasts (no padding, no copy, and an
// in-place contribution works as NCCL's in-place broadcast), and a plain
// ncclAllGather when all sizes are equal (the common case, NCCL's fastest
// path).
#include "server/backend/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace qtx::server::backend {
namespace {

// NCCL status -> absl::Status: remote and system errors (a peer died, the
// network failed) are UNAVAILABLE, everything else INTERNAL. The message
// carries the expression, file:line, ncclGetErrorString and ncclGetLastError.
absl::Status NcclErrorToStatus(const std::string& name, ncclResult_t r, const char* expr,
                               const char* file, int line, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  const std::string msg = absl::StrFormat(
      "%s: %s failed at %s:%d: %s%s%s", name, expr, file, line, ncclGetErrorString(r),
      last != nullptr && *last ? " - " : "", last != nullptr ? last : "");
  (void)cudaGetLastError();  // never leak a sticky CUDA error into the next request
  if (r == ncclRemoteError || r == ncclSystemError) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

absl::Status CudaErrorStatus(const std::string& name, cudaError_t e, const char* expr,
                             const char* file, int line) {
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrFormat("%s: %s failed at %s:%d: %s (%s)", name, expr, file,
                                             line, cudaGetErrorName(e), cudaGetErrorString(e)));
}

}  // namespace

// ncclInProgress is not an error for a nonblocking communicator: the caller
// polls ncclCommGetAsyncError next.
#define QTX_NCCL_RETURN_IF_ERROR(expr, comm)                                           \
  do {                                                                                 \
    const ncclResult_t qtx_nccl_r_ = (expr);                                           \
    if (qtx_nccl_r_ != ncclSuccess && qtx_nccl_r_ != ncclInProgress) {                 \
      return NcclErrorToStatus(name_, qtx_nccl_r_, #expr, __FILE__, __LINE__, (comm)); \
    }                                                                                  \
  } while (false)

#define QTX_NCCL_CUDA_RETURN_IF_ERROR(expr)                                  \
  do {                                                                       \
    const cudaError_t qtx_cuda_e_ = (expr);                                  \
    if (qtx_cuda_e_ != cudaSuccess) {                                        \
      return CudaErrorStatus(name_, qtx_cuda_e_, #expr, __FILE__, __LINE__); \
    }                                                                        \
  } while (false)

namespace {

// Polls `done` (true when finished, or an error) until the deadline; spins
// with yields for the first 2 ms (collectives are often that short), then
// sleeps 50 us between polls.
template <typename Fn>
absl::StatusOr<bool> PollUntil(absl::Time deadline, Fn done) {
  const absl::Time start = absl::Now();
  for (;;) {
    absl::StatusOr<bool> d = done();
    if (!d.ok() || *d) return d;
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    if (now - start < absl::Milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclCommunicatorOptions& options) {
  const std::string name_ =
      absl::StrFormat("nccl[group=%s rank=%d/%d cuda:%d]", options.group, options.rank,
                      options.world_size, options.device_ordinal);
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: world_size=%d: must be >= 1", name_, options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: rank=%d: must be in [0, %d)", name_,
                                                      options.rank, options.world_size));
  }
  if (options.store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": no rendezvous store"));
  }
  if (options.device_ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: device_ordinal=%d: must be >= 0", name_, options.device_ordinal));
  }
  if (absl::Now() >= options.deadline) {
    return absl::DeadlineExceededError(absl::StrCat(name_, ": deadline passed before connecting"));
  }
  QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device_ordinal));

  // The unique id, through the rendezvous store.
  const std::string key = options.key_prefix + "nccl/unique_id";
  ncclUniqueId id;
  if (options.rank == 0) {
    QTX_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id), nullptr);
    absl::Status s = options.store->Set(
        key, std::string_view(reinterpret_cast<const char*>(&id), sizeof id), options.deadline);
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(name_, ": publishing the NCCL unique id: ", s.message()));
    }
  } else {
    const std::string keys[1] = {key};
    absl::StatusOr<std::vector<std::string>> v = options.store->Get(keys, options.deadline);
    if (!v.ok()) {
      return absl::Status(
          v.status().code(),
          absl::StrCat(name_, ": waiting for rank 0's NCCL unique id: ", v.status().message()));
    }
    if ((*v)[0].size() != sizeof id) {
      return absl::InternalError(absl::StrFormat("%s: the NCCL unique id has %d bytes, expected %d",
                                                 name_, (*v)[0].size(), sizeof id));
    }
    std::memcpy(&id, (*v)[0].data(), sizeof id);
  }

  // Nonblocking init, polled until ready or the deadline.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t init =
      ncclCommInitRankConfig(&comm, options.world_size, id, options.rank, &config);
  if (init != ncclSuccess && init != ncclInProgress) {
    absl::Status s =
        NcclErrorToStatus(name_, init, "ncclCommInitRankConfig", __FILE__, __LINE__, comm);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return s;
  }
  ncclResult_t state = ncclInProgress;
  absl::StatusOr<bool> ready = PollUntil(options.deadline, [&]() -> absl::StatusOr<bool> {
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) state = r;
    return state != ncclInProgress;
  });
  if (!*ready || state != ncclSuccess) {
    absl::Status s =
        !*ready ? absl::DeadlineExceededError(absl::StrFormat(
                      "%s: not every rank joined the NCCL communicator before the deadline "
                      "(the half-built communicator was aborted)",
                      name_))
                : NcclErrorToStatus(name_, state, "ncclCommInitRankConfig (async)", __FILE__,
                                    __LINE__, comm);
    (void)ncclCommAbort(comm);
    return s;
  }
  // The blocking child: an asynchronous job of the nonblocking parent.
  ncclConfig_t child_config = NCCL_CONFIG_INITIALIZER;
  child_config.blocking = 1;
  ncclComm_t child = nullptr;
  const ncclResult_t split = ncclCommSplit(comm, 0, options.rank, &child, &child_config);
  if (split != ncclSuccess && split != ncclInProgress) {
    absl::Status s = NcclErrorToStatus(name_, split, "ncclCommSplit", __FILE__, __LINE__, comm);
    (void)ncclCommAbort(comm);
    return s;
  }
  state = ncclInProgress;
  ready = PollUntil(options.deadline, [&]() -> absl::StatusOr<bool> {
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) state = r;
    // NCCL publishes the child when its init job has finished.
    return state != ncclInProgress &&
           (state != ncclSuccess || __atomic_load_n(&child, __ATOMIC_ACQUIRE) != nullptr);
  });
  if (!*ready || state != ncclSuccess) {
    absl::Status s =
        !*ready
            ? absl::DeadlineExceededError(absl::StrFormat(
                  "%s: not every rank joined the blocking NCCL communicator (ncclCommSplit) "
                  "before the deadline (both communicators were aborted)",
                  name_))
            : NcclErrorToStatus(name_, state, "ncclCommSplit (async)", __FILE__, __LINE__, comm);
    (void)ncclCommAbort(comm);  // also stops the child's init
    if (ncclComm_t c = __atomic_load_n(&child, __ATOMIC_ACQUIRE); c != nullptr) {
      (void)ncclCommAbort(c);
    }
    return s;
  }
  child = __atomic_load_n(&child, __ATOMIC_ACQUIRE);
  auto abort_both = [&] {
    (void)ncclCommAbort(child);
    (void)ncclCommAbort(comm);
    (void)cudaGetLastError();
  };

  float* scratch = nullptr;
  cudaStream_t side = nullptr;
  if (cudaError_t e = cudaMalloc(&scratch, sizeof(float)); e != cudaSuccess) {
    abort_both();
    return CudaErrorStatus(name_, e, "cudaMalloc(barrier scratch)", __FILE__, __LINE__);
  }
  if (cudaError_t e = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking); e != cudaSuccess) {
    abort_both();
    (void)cudaFree(scratch);
    return CudaErrorStatus(name_, e, "cudaStreamCreateWithFlags", __FILE__, __LINE__);
  }
  auto cleanup = [&] {
    abort_both();
    (void)cudaStreamDestroy(side);
    (void)cudaFree(scratch);
    (void)cudaGetLastError();
  };

  // Warm-up of the child on a helper thread: every collective kind the ops
  // use, small and large, so that NCCL sets up its connections (which waits
  // for the peers on the host) here, where the deadline still holds.
  std::atomic<int> warm_state{0};  // 0 running, 1 done, 2 failed
  std::string warm_error;
  const int device = options.device_ordinal;
  const int world = options.world_size;
  const int me = options.rank;
  std::thread warm([&, device, world, me] {
    auto fail = [&](std::string what) {
      warm_error = std::move(what);
      warm_state.store(2);
    };
    if (cudaSetDevice(device) != cudaSuccess) return fail("cudaSetDevice");
    constexpr uint64_t kLarge = uint64_t{4} << 20;  // bytes per rank
    void* buf = nullptr;
    const uint64_t total = kLarge * static_cast<uint64_t>(world) + 4096;
    if (cudaMalloc(&buf, total) != cudaSuccess) return fail("cudaMalloc(warm-up)");
    auto* b = static_cast<char*>(buf);
    ncclResult_t r = ncclSuccess;
    auto step = [&](ncclResult_t x, const char* what) {
      if (r == ncclSuccess && x != ncclSuccess) {
        r = x;
        warm_error = what;
      }
    };
    step(ncclAllGather(b + 256 * me, b, 256, ncclUint8, child, side), "ncclAllGather(small)");
    step(ncclAllGather(b + kLarge * me, b, kLarge, ncclUint8, child, side), "ncclAllGather(large)");
    if (r == ncclSuccess) {
      // Unequal contributions: the grouped broadcasts of AllGatherV.
      step(ncclGroupStart(), "ncclGroupStart");
      uint64_t off = 0;
      for (int q = 0; q < world && r == ncclSuccess; ++q) {
        const uint64_t bytes = kLarge - 16 * static_cast<uint64_t>(q + 1);
        step(ncclBroadcast(b + off, b + off, bytes, ncclUint8, q, child, side), "ncclBroadcast");
        off += bytes;
      }
      step(ncclGroupEnd(), "ncclGroupEnd(broadcasts)");
    }
    step(ncclAllReduce(b, b, 1, ncclFloat32, ncclMax, child, side), "ncclAllReduce(small)");
    step(ncclAllReduce(b, b, kLarge / 4, ncclFloat32, ncclMax, child, side),
         "ncclAllReduce(large)");
    const cudaError_t e = cudaStreamSynchronize(side);
    (void)cudaFree(buf);
    if (r != ncclSuccess) return fail(absl::StrCat(warm_error, ": ", ncclGetErrorString(r)));
    if (e != cudaSuccess) return fail(absl::StrCat("cudaStreamSynchronize: ", cudaGetErrorName(e)));
    warm_state.store(1);
  });
  ready = PollUntil(options.deadline, [&]() -> absl::StatusOr<bool> {
    if (warm_state.load() != 0) return true;
    ncclResult_t st = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(child, &st);
    if (q != ncclSuccess) st = q;
    if (st != ncclSuccess && st != ncclInProgress) {
      return NcclErrorToStatus(name_, st, "warm-up (async)", __FILE__, __LINE__, child);
    }
    return false;
  });
  if (!ready.ok() || !*ready || warm_state.load() != 1) {
    const bool running = warm_state.load() == 0;
    if (running) (void)ncclCommAbort(child);  // unblocks the helper's NCCL call
    warm.join();
    absl::Status s =
        !ready.ok() ? ready.status()
        : running
            ? absl::DeadlineExceededError(
                  absl::StrFormat("%s: a peer did not take part in the communicator's "
                                  "warm-up before the deadline (both communicators were "
                                  "aborted)",
                                  name_))
            : absl::InternalError(absl::StrFormat("%s: warm-up failed: %s", name_, warm_error));
    if (running) {
      (void)ncclCommAbort(comm);
      (void)cudaStreamDestroy(side);
      (void)cudaFree(scratch);
      (void)cudaGetLastError();
    } else {
      cleanup();
    }
    return s;
  }
  warm.join();
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(name_, options.rank, options.world_size, options.device_ordinal, comm,
                           child, scratch, side, options.default_stream));
}

NcclCommunicator::NcclCommunicator(std::string name, int rank, int world_size, int device,
                                   ncclComm* parent, ncclComm* comm, float* scratch,
                                   void* side_stream,
                                   std::function<absl::StatusOr<void*>()> default_stream)
    : name_(std::move(name)),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      default_stream_(std::move(default_stream)),
      scratch_(scratch),
      side_stream_(side_stream),
      parent_(parent),
      comm_(comm) {}

NcclCommunicator::~NcclCommunicator() {
  (void)cudaSetDevice(device_);
  ncclComm* c = nullptr;
  ncclComm* p = nullptr;
  {
    absl::MutexLock lock(&mu_);
    c = std::exchange(comm_, nullptr);
    p = std::exchange(parent_, nullptr);
  }
  // Abort, not Destroy: it never waits for peers that may be gone.
  if (c != nullptr) (void)ncclCommAbort(c);
  if (p != nullptr) (void)ncclCommAbort(p);
  if (reaper_.joinable()) reaper_.join();  // a failed call's abort
  (void)cudaSetDevice(device_);
  (void)cudaStreamDestroy(static_cast<cudaStream_t>(side_stream_));
  (void)cudaFree(scratch_);
  if (dev_buf_ != nullptr) (void)cudaFree(dev_buf_);
  if (host_buf_ != nullptr) (void)cudaFreeHost(host_buf_);
  (void)cudaGetLastError();
}

void NcclCommunicator::Abort() { abort_requested_.store(true); }

absl::Status NcclCommunicator::Fail(absl::Status status) {
  ncclComm* c = nullptr;
  ncclComm* p = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (broken_reason_.empty()) broken_reason_ = std::string(status.message());
    c = std::exchange(comm_, nullptr);
    p = std::exchange(parent_, nullptr);
  }
  if ((c != nullptr || p != nullptr) && !reaper_.joinable()) {
    // Off the request path: the abort (which also stops this communicator's
    // in-flight kernels, so the stream drains) may take long.
    const int device = device_;
    reaper_ = std::thread([c, p, device] {
      (void)cudaSetDevice(device);
      if (c != nullptr) (void)ncclCommAbort(c);
      if (p != nullptr) (void)ncclCommAbort(p);
      (void)cudaGetLastError();
    });
  } else if (c != nullptr || p != nullptr) {
    (void)cudaSetDevice(device_);
    if (c != nullptr) (void)ncclCommAbort(c);
    if (p != nullptr) (void)ncclCommAbort(p);
    (void)cudaGetLastError();
  }
  (void)cudaGetLastError();
  return status;
}

absl::StatusOr<void*> NcclCommunicator::Begin(const CommCall& call, const char* op) {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_reason_.empty()) {
      return absl::AbortedError(absl::StrFormat("%s: %s: unusable after an earlier failure: %s",
                                                name_, op, broken_reason_));
    }
  }
  if (abort_requested_.load()) {
    return Fail(
        absl::AbortedError(absl::StrFormat("%s: %s: the communicator was aborted", name_, op)));
  }
  if (absl::Now() >= call.deadline) {
    return Fail(absl::DeadlineExceededError(
        absl::StrFormat("%s: %s: the deadline passed before the call began", name_, op)));
  }
  QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (call.stream != nullptr) return call.stream;
  if (default_stream_) {
    absl::StatusOr<void*> s = default_stream_();
    if (!s.ok()) {
      return absl::Status(s.status().code(), absl::StrCat(name_, ": ", s.status().message()));
    }
    QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return *s;
  }
  return nullptr;
}

absl::Status NcclCommunicator::Finish(int enqueued, void* stream_ptr, absl::Time deadline,
                                      const char* op, bool enqueue_only) {
  ncclComm* comm = nullptr;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  const ncclResult_t r = static_cast<ncclResult_t>(enqueued);
  if (r != ncclSuccess && r != ncclInProgress) {
    return Fail(NcclErrorToStatus(name_, r, op, __FILE__, __LINE__, comm));
  }
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (enqueue_only) {
    // The collectives run on the blocking child communicator: a call that
    // returned ncclSuccess has enqueued its work on `stream`. No wait: the
    // caller orders what follows on the stream (CommCall::enqueue_only).
    // NCCL's asynchronous error is checked once, so a communicator that has
    // already failed is reported now.
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) state = q;
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(NcclErrorToStatus(name_, state, op, __FILE__, __LINE__, comm));
    }
    if (r == ncclSuccess) return absl::OkStatus();
    // ncclInProgress (not expected of a blocking communicator): fall through
    // to the wait, which polls until NCCL has enqueued and the work is done.
  }
  // Until NCCL has enqueued (nonblocking group end), then until the stream
  // has run it; NCCL's async error is checked at every poll.
  bool enqueued_done = r == ncclSuccess;
  absl::Status failure;
  absl::StatusOr<bool> done = PollUntil(deadline, [&]() -> absl::StatusOr<bool> {
    if (abort_requested_.load()) {
      return absl::AbortedError(
          absl::StrFormat("%s: %s: aborted while waiting for the peers", name_, op));
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) state = q;
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclErrorToStatus(name_, state, op, __FILE__, __LINE__, comm);
    }
    if (!enqueued_done) {
      if (state == ncclInProgress) return false;
      enqueued_done = true;
    }
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) return CudaErrorStatus(name_, e, "cudaStreamQuery", __FILE__, __LINE__);
    return true;
  });
  if (!done.ok()) return Fail(done.status());
  if (!*done) {
    return Fail(absl::DeadlineExceededError(absl::StrFormat(
        "%s: %s: a peer did not take part before the deadline (the NCCL communicator was "
        "aborted)",
        name_, op)));
  }
  return absl::OkStatus();
}

int NcclCommunicator::EnqueueGather(std::span<const GatherPart> parts, ncclComm* comm,
                                    void* stream_ptr) {
  auto s = static_cast<cudaStream_t>(stream_ptr);
  auto keep = [](ncclResult_t& res, ncclResult_t r) {
    if (r != ncclSuccess && r != ncclInProgress && res == ncclSuccess) res = r;
  };
  ncclResult_t res = ncclGroupStart();
  if (res != ncclSuccess) return res;
  for (const GatherPart& p : parts) {
    const std::span<const uint64_t> sizes = p.recv_bytes;
    if (std::all_of(sizes.begin(), sizes.end(), [](uint64_t b) { return b == 0; })) continue;
    const bool equal =
        std::all_of(sizes.begin(), sizes.end(), [&](uint64_t b) { return b == sizes[0]; });
    auto* out = static_cast<char*>(p.recv);
    if (equal) {
      keep(res, ncclAllGather(p.send, p.recv, sizes[0], ncclUint8, comm, s));
      continue;
    }
    uint64_t off = 0;
    for (int r = 0; r < world_size_; ++r) {
      if (sizes[r] > 0) {
        const void* src = r == rank_ ? p.send : out + off;
        keep(res, ncclBroadcast(src, out + off, sizes[r], ncclUint8, r, comm, s));
      }
      off += sizes[r];
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  return res == ncclSuccess ? end : res;
}

absl::Status NcclCommunicator::AllGatherV(const void* send, std::span<const uint64_t> recv_bytes,
                                          void* recv, const CommCall& call) {
  const GatherPart part{send, recv_bytes, recv};
  return AllGatherVParts(std::span<const GatherPart>(&part, 1), call);
}

absl::Status NcclCommunicator::AllGatherVParts(std::span<const GatherPart> parts,
                                               const CommCall& call) {
  for (const GatherPart& p : parts) {
    if (p.recv_bytes.size() != static_cast<size_t>(world_size_)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: AllGatherV: recv_bytes has %d entries, expected world_size=%d",
                          name_, p.recv_bytes.size(), world_size_));
    }
  }
  absl::StatusOr<void*> stream = Begin(call, "AllGatherV");
  if (!stream.ok()) return stream.status();
  uint64_t total = 0;
  for (const GatherPart& p : parts) {
    total += std::accumulate(p.recv_bytes.begin(), p.recv_bytes.end(), uint64_t{0});
  }
  if (total == 0) return absl::OkStatus();  // every rank passes the same sizes
  ncclComm* comm = nullptr;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  const int res = EnqueueGather(parts, comm, *stream);
  return Finish(res, *stream, call.deadline, "ncclAllGather/ncclBroadcast group",
                call.enqueue_only);
}

absl::Status NcclCommunicator::AllGatherHost(const void* send, uint64_t bytes, void* recv,
                                             const CommCall& call,
                                             const std::function<void()>& in_flight) {
  absl::StatusOr<void*> stream = Begin(call, "AllGatherHost");
  if (!stream.ok()) return stream.status();
  if (bytes == 0) {
    if (in_flight) in_flight();
    return absl::OkStatus();
  }
  if (world_size_ == 1) {
    // One rank: every rank's bytes are this rank's. No GPU round trip: on an
    // H200 the side stream's copies were seen waiting behind device work
    // parked on other streams (a stream-ordered AllGather's, held by the
    // caller), which made the host wait for the GPU.
    if (in_flight) in_flight();
    std::memcpy(recv, send, bytes);
    return absl::OkStatus();
  }
  const uint64_t need = bytes * static_cast<uint64_t>(world_size_);
  if (need > host_bytes_) {
    // Grown rarely (the messages are small and of few sizes), kept for reuse.
    if (dev_buf_ != nullptr) QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaFree(dev_buf_));
    if (host_buf_ != nullptr) QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaFreeHost(host_buf_));
    dev_buf_ = host_buf_ = nullptr;
    host_bytes_ = 0;
    const uint64_t alloc = std::max<uint64_t>(need, 4096);
    QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaMalloc(&dev_buf_, alloc));
    QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_buf_, alloc));
    host_bytes_ = alloc;
  }
  // The communicator's own stream: host bytes need no ordering with the
  // caller's stream, and device work the caller enqueued there overlaps.
  auto s = static_cast<cudaStream_t>(side_stream_);
  auto* host = static_cast<char*>(host_buf_);
  auto* dev = static_cast<char*>(dev_buf_);
  const uint64_t mine = bytes * static_cast<uint64_t>(rank_);
  // The previous call's copies have completed (Finish waited for the stream).
  std::memcpy(host + mine, send, bytes);
  QTX_NCCL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dev + mine, host + mine, bytes, cudaMemcpyHostToDevice, s));
  ncclComm* comm = nullptr;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  // Blocking communicator: the gather is enqueued when the call returns, so
  // the copy back goes on the same stream and one wait covers all three.
  const ncclResult_t res = ncclAllGather(dev + mine, dev, bytes, ncclUint8, comm, s);
  if (res == ncclSuccess) {
    QTX_NCCL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, dev, need, cudaMemcpyDeviceToHost, s));
    // The gather's kernel is queued ahead of whatever the caller launches now
    // (a persistent quantize grid would otherwise hold every SM until done).
    if (in_flight) in_flight();
  }
  absl::Status st = Finish(res, s, call.deadline, "ncclAllGather(agreement)");
  if (!st.ok()) return st;
  std::memcpy(recv, host, need);
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllReduceMax(float* data, uint64_t count, const CommCall& call) {
  absl::StatusOr<void*> stream = Begin(call, "AllReduceMax");
  if (!stream.ok()) return stream.status();
  if (count == 0) return absl::OkStatus();
  ncclComm* comm = nullptr;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  auto s = static_cast<cudaStream_t>(*stream);
  return Finish(ncclAllReduce(data, data, count, ncclFloat32, ncclMax, comm, s), s, call.deadline,
                "ncclAllReduce(max)", call.enqueue_only);
}

absl::Status NcclCommunicator::Barrier(const CommCall& call) {
  absl::StatusOr<void*> stream = Begin(call, "Barrier");
  if (!stream.ok()) return stream.status();
  ncclComm* comm = nullptr;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  auto s = static_cast<cudaStream_t>(*stream);
  return Finish(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclMax, comm, s), s,
                call.deadline, "ncclAllReduce(barrier)", call.enqueue_only);
}

}  // namespace qtx::server::backend

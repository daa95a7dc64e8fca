#include "server/backend/cuda_device.h"

#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cuda_driver.h"
#include "common/status_macros.h"
#include "kernels/block_geometry.h"
#include "kernels/cuda/quantize_block.h"
#include "kernels/cuda/quantize_shard.h"
#include "kernels/cuda/slot_check.h"
#include "kernels/shard_geometry.h"
#include "server/backend/cuda_status.h"
#include "spdlog/spdlog.h"

namespace qtx::server::backend {
namespace {

using cuda_driver::DriverStatus;
using cuda_driver::GetMemoryOps;
using cuda_driver::GetStreamMemOps;
using cuda_driver::MemoryOps;
using cuda_driver::StreamMemOps;

std::string HexPrefix(std::string_view bytes) {
  std::string out;
  for (size_t i = 0; i < std::min<size_t>(bytes.size(), 8); ++i) {
    out += absl::StrFormat("%02x", static_cast<unsigned char>(bytes[i]));
  }
  return out;
}

absl::Status CheckEventLength(std::string_view handle, std::string_view field) {
  if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %d bytes, must be exactly %d (a cudaIpcEventHandle_t)", field,
                        handle.size(), sizeof(cudaIpcEventHandle_t)));
  }
  return absl::OkStatus();
}

}  // namespace

int VisibleCudaDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(int ordinal,
                                                               const CudaDeviceOptions& options) {
  if (options.streams < 1 || options.streams > 256) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda: streams=%d: must be 1..256", options.streams));
  }
  if (options.staging_chunk_bytes < 4096) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda: staging_chunk_bytes=%d: must be >= 4096", options.staging_chunk_bytes));
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // No driver, no device, or a driver too old: the host cannot run CUDA.
    const absl::Status s = CudaErrorToStatus(err, "cudaGetDeviceCount", __FILE__, __LINE__);
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda:%d: no usable CUDA device on this host (is there a GPU and a recent enough NVIDIA "
        "driver?): %s",
        ordinal, s.message()));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::NotFoundError(
        absl::StrFormat("cuda:%d: no such device: this process sees %d CUDA device(s) (check "
                        "CUDA_VISIBLE_DEVICES)",
                        ordinal, count));
  }
  std::unique_ptr<CudaDevice> device(new CudaDevice(ordinal, options));
  QTX_RETURN_IF_ERROR(device->Init());
  return device;
}

CudaDevice::CudaDevice(int ordinal, const CudaDeviceOptions& options)
    : ordinal_(ordinal), options_(options) {}

absl::Status CudaDevice::Init() {
  QTX_RETURN_IF_ERROR(Activate());
  QTX_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));  // creates the primary context now
  for (int i = 0; i < options_.streams; ++i) {
    cudaStream_t s = nullptr;
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    streams_.push_back(s);
  }
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = ordinal_;
  QTX_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool_, &props));
  uint64_t threshold = options_.pool_release_threshold;
  QTX_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
  // Kernels' own stream-ordered temporaries (cudaMallocAsync) come from this
  // pool too: the default pool returns its memory at every synchronization
  // (release threshold 0), so each call would map memory afresh.
  QTX_CUDA_RETURN_IF_ERROR(cudaDeviceSetMemPool(ordinal_, pool_));
  return absl::OkStatus();
}

CudaDevice::~CudaDevice() {
  if (cudaSetDevice(ordinal_) != cudaSuccess) (void)cudaGetLastError();
  for (cudaStream_t s : streams_) {
    if (cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
  }
  {
    absl::MutexLock lock(&mu_);
    events_.clear();  // each SharedEvent destroys its event
    event_order_.clear();
    for (auto& pair : staging_all_) {
      for (int i = 0; i < 2; ++i) {
        if (pair->done[i] != nullptr) (void)cudaEventDestroy(pair->done[i]);
        if (pair->host[i] != nullptr) (void)cudaFreeHost(pair->host[i]);
      }
    }
    staging_all_.clear();
    staging_free_.clear();
    for (auto& [size, p] : host_visible_free_) (void)cudaFreeHost(p);
    host_visible_free_.clear();
  }
  for (cudaStream_t s : streams_) {
    // Synchronized above: the quantize kernel's tile counter can serve another stream.
    (void)kernels::cuda::ForgetStreamTileCounter(s);
    (void)cudaStreamDestroy(s);
  }
  if (pool_ != nullptr) {
    cudaMemPool_t current = nullptr, fallback = nullptr;
    if (cudaDeviceGetMemPool(&current, ordinal_) == cudaSuccess && current == pool_ &&
        cudaDeviceGetDefaultMemPool(&fallback, ordinal_) == cudaSuccess) {
      (void)cudaDeviceSetMemPool(ordinal_, fallback);
    }
    (void)cudaMemPoolDestroy(pool_);
  }
  (void)cudaGetLastError();
}

std::string CudaDevice::name() const { return absl::StrFormat("cuda:%d", ordinal_); }

absl::Status CudaDevice::Activate() const {
  QTX_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
  return absl::OkStatus();
}

cudaStream_t CudaDevice::ThisThreadStream() const {
  // Each thread takes the next slot once; slot % streams picks its stream, so
  // one request's calls (one thread) stay in order on one stream.
  static std::atomic<uint32_t> next_slot{0};
  thread_local const uint32_t slot = next_slot.fetch_add(1, std::memory_order_relaxed);
  return streams_[slot % streams_.size()];
}

absl::StatusOr<DeviceBuffer> CudaDevice::Allocate(uint64_t bytes) {
  if (bytes == 0) return DeviceBuffer();
  QTX_RETURN_IF_ERROR(Activate());
  cudaStream_t stream = ThisThreadStream();
  void* p = nullptr;
  const cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, pool_, stream);
  if (err != cudaSuccess) {
    absl::Status s = CudaErrorToStatus(err, "cudaMallocFromPoolAsync", __FILE__, __LINE__);
    return absl::Status(s.code(), absl::StrFormat("cuda:%d: cannot allocate %d bytes: %s", ordinal_,
                                                  bytes, s.message()));
  }
  const int ordinal = ordinal_;
  return DeviceBuffer(p, bytes, [stream, ordinal](void* q) {
    // Stream-ordered: the memory returns to the pool after the work queued
    // on `stream` so far. Errors here cannot be reported; they are logged.
    if (cudaSetDevice(ordinal) != cudaSuccess || cudaFreeAsync(q, stream) != cudaSuccess) {
      const cudaError_t e = cudaGetLastError();
      spdlog::warn("event=cuda_free_failed device=cuda:{} error={}", ordinal, cudaGetErrorName(e));
    }
  });
}

absl::StatusOr<CudaDevice::StagingPair*> CudaDevice::AcquireStaging() {
  {
    absl::MutexLock lock(&mu_);
    if (!staging_free_.empty()) {
      StagingPair* pair = staging_free_.back();
      staging_free_.pop_back();
      return pair;
    }
  }
  auto pair = std::make_unique<StagingPair>();
  absl::Status status;
  for (int i = 0; i < 2 && status.ok(); ++i) {
    const cudaError_t e1 = cudaMallocHost(&pair->host[i], options_.staging_chunk_bytes);
    if (e1 != cudaSuccess) {
      status = CudaErrorToStatus(e1, "cudaMallocHost(staging)", __FILE__, __LINE__);
      break;
    }
    const cudaError_t e2 = cudaEventCreateWithFlags(&pair->done[i], cudaEventDisableTiming);
    if (e2 != cudaSuccess) status = CudaErrorToStatus(e2, "cudaEventCreate", __FILE__, __LINE__);
  }
  if (!status.ok()) {
    for (int i = 0; i < 2; ++i) {
      if (pair->done[i] != nullptr) (void)cudaEventDestroy(pair->done[i]);
      if (pair->host[i] != nullptr) (void)cudaFreeHost(pair->host[i]);
    }
    return status;
  }
  StagingPair* raw = pair.get();
  absl::MutexLock lock(&mu_);
  staging_all_.push_back(std::move(pair));
  return raw;
}

void CudaDevice::ReleaseStaging(StagingPair* pair) {
  absl::MutexLock lock(&mu_);
  staging_free_.push_back(pair);
}

absl::Status CudaDevice::CopyFromHost(void* device_dst, const void* host_src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  QTX_RETURN_IF_ERROR(Activate());
  cudaStream_t stream = ThisThreadStream();
  QTX_ASSIGN_OR_RETURN(StagingPair * pair, AcquireStaging());
  const uint64_t chunk = options_.staging_chunk_bytes;
  auto copy = [&]() -> absl::Status {
    const auto* src = static_cast<const std::byte*>(host_src);
    auto* dst = static_cast<std::byte*>(device_dst);
    uint64_t i = 0;
    for (uint64_t off = 0; off < bytes; off += chunk, ++i) {
      const int b = static_cast<int>(i & 1);
      const uint64_t n = std::min(chunk, bytes - off);
      // The buffer's previous chunk (i - 2) must have left for the device.
      if (i >= 2) QTX_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(pair->done[b]));
      std::memcpy(pair->host[b], src + off, n);
      QTX_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst + off, pair->host[b], n, cudaMemcpyHostToDevice, stream));
      QTX_CUDA_RETURN_IF_ERROR(cudaEventRecord(pair->done[b], stream));
    }
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  };
  absl::Status status = copy();
  // Never hand the pair to another copy while this one may still read it.
  if (!status.ok() && cudaStreamSynchronize(stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return status;  // the pair is leaked rather than reused unsafely
  }
  ReleaseStaging(pair);
  return status;
}

absl::Status CudaDevice::CopyToHost(void* host_dst, const void* device_src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  QTX_RETURN_IF_ERROR(Activate());
  cudaStream_t stream = ThisThreadStream();
  QTX_ASSIGN_OR_RETURN(StagingPair * pair, AcquireStaging());
  const uint64_t chunk = options_.staging_chunk_bytes;
  const uint64_t chunks = (bytes + chunk - 1) / chunk;
  auto copy = [&]() -> absl::Status {
    const auto* src = static_cast<const std::byte*>(device_src);
    auto* dst = static_cast<std::byte*>(host_dst);
    auto enqueue = [&](uint64_t i) -> absl::Status {
      const int b = static_cast<int>(i & 1);
      const uint64_t off = i * chunk;
      const uint64_t n = std::min(chunk, bytes - off);
      QTX_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(pair->host[b], src + off, n, cudaMemcpyDeviceToHost, stream));
      QTX_CUDA_RETURN_IF_ERROR(cudaEventRecord(pair->done[b], stream));
      return absl::OkStatus();
    };
    QTX_RETURN_IF_ERROR(enqueue(0));
    for (uint64_t i = 0; i < chunks; ++i) {
      // Chunk i + 1 goes into the buffer chunk i - 1 used (already drained).
      if (i + 1 < chunks) QTX_RETURN_IF_ERROR(enqueue(i + 1));
      const int b = static_cast<int>(i & 1);
      QTX_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(pair->done[b]));
      const uint64_t off = i * chunk;
      std::memcpy(dst + off, pair->host[b], std::min(chunk, bytes - off));
    }
    return absl::OkStatus();
  };
  absl::Status status = copy();
  if (!status.ok() && cudaStreamSynchronize(stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return status;
  }
  ReleaseStaging(pair);
  return status;
}

absl::StatusOr<CudaDevice::SharedEvent> CudaDevice::OpenIpcEvent(std::string_view handle,
                                                                 std::string_view field) {
  QTX_RETURN_IF_ERROR(CheckEventLength(handle, field));
  {
    absl::MutexLock lock(&mu_);
    auto it = events_.find(handle);
    if (it != events_.end()) return it->second;
  }
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t event = nullptr;
  const cudaError_t err = cudaIpcOpenEventHandle(&event, h);
  if (err != cudaSuccess) {
    const absl::Status s = CudaErrorToStatus(err, "cudaIpcOpenEventHandle", __FILE__, __LINE__);
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s (handle %s...): cannot open the interprocess event: %s (it must come from "
        "cudaIpcGetEventHandle on an event created with cudaEventInterprocess | "
        "cudaEventDisableTiming in a live process on this machine)",
        field, HexPrefix(handle), s.message()));
  }
  SharedEvent shared(event, [ordinal = ordinal_](cudaEvent_t e) {
    if (cudaSetDevice(ordinal) != cudaSuccess || cudaEventDestroy(e) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  });
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = events_.emplace(std::string(handle), shared);
  if (!inserted) return it->second;  // another thread opened it meanwhile
  event_order_.emplace_back(handle);
  while (event_order_.size() > options_.max_cached_events) {
    events_.erase(event_order_.front());  // holders keep their copy alive
    event_order_.pop_front();
  }
  return shared;
}

absl::Status CudaDevice::FinishOp(const CudaEvents& events, cudaStream_t stream) {
  if (events.signal_event.empty()) {
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  QTX_ASSIGN_OR_RETURN(SharedEvent event,
                       OpenIpcEvent(events.signal_event, "cuda_events.signal_event"));
  QTX_CUDA_RETURN_IF_ERROR(cudaEventRecord(event.get(), stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::StreamWaitsForStream(cudaStream_t waiter, cudaStream_t producer) {
  cudaEvent_t event = nullptr;
  QTX_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  cudaError_t err = cudaEventRecord(event, producer);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(waiter, event, 0);
  // Destroying a recorded event is fine: its resources go once it completes.
  (void)cudaEventDestroy(event);
  if (err != cudaSuccess) return CudaErrorToStatus(err, "cudaStreamWaitEvent", __FILE__, __LINE__);
  return absl::OkStatus();
}

absl::Status CudaDevice::OrderAfterClient(const CudaEvents& events) {
  if (events.queue != nullptr) {
    QTX_RETURN_IF_ERROR(Activate());
    QTX_RETURN_IF_ERROR(StreamWaitsForStream(ThisThreadStream(), QueueStream(events.queue)));
  }
  if (events.empty()) return absl::OkStatus();
  QTX_RETURN_IF_ERROR(Activate());
  // Open both events before anything is enqueued, so that a bad signal
  // handle fails the call before any work runs.
  if (!events.signal_event.empty()) {
    QTX_RETURN_IF_ERROR(OpenIpcEvent(events.signal_event, "cuda_events.signal_event").status());
  }
  if (events.wait_event.empty()) return absl::OkStatus();
  QTX_ASSIGN_OR_RETURN(SharedEvent event,
                       OpenIpcEvent(events.wait_event, "cuda_events.wait_event"));
  QTX_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ThisThreadStream(), event.get(), 0));
  return absl::OkStatus();
}

absl::Status CudaDevice::SignalClient(const CudaEvents& events) {
  if (events.queue != nullptr) {
    QTX_RETURN_IF_ERROR(Activate());
    QTX_RETURN_IF_ERROR(StreamWaitsForStream(QueueStream(events.queue), ThisThreadStream()));
  }
  if (events.signal_event.empty()) return absl::OkStatus();
  QTX_RETURN_IF_ERROR(Activate());
  return FinishOp(events, ThisThreadStream());
}

absl::Status CudaDevice::Quantize(const QuantizeArgs& args) {
  QTX_RETURN_IF_ERROR(Activate());
  if (args.queue != nullptr) {
    QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::QuantizeBlock(
        args.input, args.dtype, args.m, args.n, args.params, args.out, QueueStream(args.queue)));
    return absl::OkStatus();  // enqueued; the channel's done write marks completion
  }
  cudaStream_t stream = ThisThreadStream();
  QTX_RETURN_IF_ERROR(OrderAfterClient(args.events));
  QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::QuantizeBlock(args.input, args.dtype, args.m, args.n,
                                                        args.params, args.out, stream));
  return FinishOp(args.events, stream);
}

absl::Status CudaDevice::Dequantize(const DequantizeArgs& args) {
  QTX_RETURN_IF_ERROR(Activate());
  if (args.queue != nullptr) {
    QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::DequantizeBlock(
        args.in, args.scaling, args.format, args.m, args.n, args.use_rowwise, args.out_dtype,
        args.out, QueueStream(args.queue)));
    return absl::OkStatus();
  }
  cudaStream_t stream = ThisThreadStream();
  QTX_RETURN_IF_ERROR(OrderAfterClient(args.events));
  QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::DequantizeBlock(args.in, args.scaling, args.format,
                                                          args.m, args.n, args.use_rowwise,
                                                          args.out_dtype, args.out, stream));
  return FinishOp(args.events, stream);
}

// ---- Exact all-gather building blocks: kernels/cuda/quantize_shard ----

absl::Status CudaDevice::ShardBoundaryAmax(const ShardArgs& args, float* first, float* last) {
  QTX_RETURN_IF_ERROR(Activate());
  cudaStream_t stream = ThisThreadStream();
  QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::ShardBoundaryAmax(
      args.input, args.dtype, args.geom, args.params.scaling, first, last, stream));
  return absl::OkStatus();  // stream-ordered (device.h)
}

absl::Status CudaDevice::QuantizeShard(const ShardArgs& args, const float* first_amax,
                                       const float* last_amax,
                                       const kernels::QuantizedBuffers& out) {
  QTX_RETURN_IF_ERROR(Activate());
  cudaStream_t stream = ThisThreadStream();
  QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::QuantizeShard(
      args.input, args.dtype, args.geom, args.params, first_amax, last_amax, out, stream));
  return absl::OkStatus();  // stream-ordered (device.h)
}

absl::Status CudaDevice::AssembleShards(int world_size, const kernels::ShardGeometry* geoms,
                                        const kernels::QuantizedConstBuffers* shards,
                                        const kernels::QuantizeParams& params,
                                        const kernels::QuantizedBuffers& out) {
  QTX_RETURN_IF_ERROR(Activate());
  cudaStream_t stream = ThisThreadStream();
  QTX_CUDA_RETURN_IF_ERROR(
      kernels::cuda::AssembleShards(world_size, geoms, shards, params, out, stream));
  return absl::OkStatus();  // stream-ordered (device.h); SynchronizeThisThread waits
}

absl::Status CudaDevice::CombineBoundaryAmax(int world_size, const kernels::ShardGeometry* geoms,
                                             const float* gathered, int64_t len, int rank,
                                             kernels::BlockScaling scaling, float* first_out,
                                             float* last_out) {
  QTX_RETURN_IF_ERROR(Activate());
  QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::CombineBoundaryAmax(
      world_size, geoms, gathered, len, rank, scaling, first_out, last_out, ThisThreadStream()));
  return absl::OkStatus();  // stream-ordered (device.h)
}

absl::Status CudaDevice::CopyOnDevice(void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  QTX_RETURN_IF_ERROR(Activate());
  QTX_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ThisThreadStream()));
  return absl::OkStatus();  // stream-ordered (device.h); src may be mapped host memory
}

absl::StatusOr<DeviceBuffer> CudaDevice::AllocateHostVisible(uint64_t bytes) {
  if (bytes == 0) return DeviceBuffer();
  QTX_RETURN_IF_ERROR(Activate());
  uint64_t size = 4096;
  while (size < bytes) size *= 2;
  void* p = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = host_visible_free_.find(size);
    if (it != host_visible_free_.end()) {
      p = it->second;
      host_visible_free_.erase(it);
    }
  }
  if (p == nullptr) {
    QTX_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, size, cudaHostAllocMapped | cudaHostAllocPortable));
  }
  std::memset(p, 0, size);
  struct Returned {
    CudaDevice* device;
    void* p;
    uint64_t size;
  };
  cudaStream_t stream = ThisThreadStream();
  return DeviceBuffer(p, bytes, [this, stream, size](void* q) {
    // Back to the pool once the work enqueued on `stream` so far has run
    // (it may still write the block).
    auto* r = new Returned{this, q, size};
    auto back = +[](void* arg) {
      auto* ret = static_cast<Returned*>(arg);
      {
        absl::MutexLock lock(&ret->device->mu_);
        ret->device->host_visible_free_.emplace(ret->size, ret->p);
      }
      delete ret;
    };
    if (cudaSetDevice(ordinal_) != cudaSuccess ||
        cudaLaunchHostFunc(stream, back, r) != cudaSuccess) {
      (void)cudaGetLastError();
      if (cudaStreamSynchronize(stream) != cudaSuccess) {
        (void)cudaGetLastError();
        delete r;  // leaked rather than reused while the GPU may write it
        return;
      }
      back(r);
    }
  });
}

absl::Status CudaDevice::CheckSlotHeaders(const SlotHeaderCheck& a) {
  QTX_RETURN_IF_ERROR(Activate());
  QTX_CUDA_RETURN_IF_ERROR(kernels::cuda::CheckSlotHeaders(
      a.slots, a.slot_stride, a.count, a.expected, a.header_bytes, a.agreed_bytes, a.rank_offset,
      a.status_offset, a.headers_out, a.bad, ThisThreadStream()));
  return absl::OkStatus();  // stream-ordered (device.h)
}

absl::Status CudaDevice::SynchronizeThisThread() {
  QTX_RETURN_IF_ERROR(Activate());
  QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ThisThreadStream()));
  return absl::OkStatus();
}

// ---- CUDA IPC memory ----

tensor::CudaUuidResolver CudaDevice::cuda_uuid_resolver() {
  return [](std::string_view uuid) -> absl::StatusOr<int32_t> {
    const int count = VisibleCudaDevices();
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp prop;
      QTX_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i));
      if (uuid.size() == sizeof(prop.uuid.bytes) &&
          std::memcmp(uuid.data(), prop.uuid.bytes, uuid.size()) == 0) {
        return i;
      }
    }
    return absl::NotFoundError(absl::StrFormat(
        "cuda_ipc.device_uuid %s...: no GPU with this UUID is visible to qtxd (%d visible; check "
        "CUDA_VISIBLE_DEVICES / the container's devices)",
        HexPrefix(uuid), count));
  };
}

tensor::CudaIpcOpener CudaDevice::cuda_ipc_opener() {
  return [this](std::string_view handle, int32_t device_id, uint64_t byte_size) {
    return OpenIpcMemory(handle, device_id, byte_size);
  };
}

namespace {

std::string CuName(const MemoryOps& ops, CUresult r) {
  const char* name = nullptr;
  if (ops.error_name != nullptr && ops.error_name(r, &name) == CUDA_SUCCESS && name != nullptr) {
    return name;
  }
  return absl::StrFormat("CUresult %d", static_cast<int>(r));
}

// What OpenVmmMemory holds: the imported handles, the range and what is
// mapped of it. Released in reverse order.
struct VmmMapping {
  MemoryOps ops;
  int ordinal = 0;
  std::vector<CUmemGenericAllocationHandle> handles;
  CUdeviceptr base = 0;
  uint64_t reserved = 0;
  std::vector<std::pair<CUdeviceptr, uint64_t>> mapped;

  void Release() {
    if (cudaSetDevice(ordinal) != cudaSuccess) (void)cudaGetLastError();
    for (const auto& [ptr, size] : mapped) {
      if (const CUresult r = ops.unmap(ptr, size); r != CUDA_SUCCESS) {
        spdlog::warn("event=cuda_vmm_unmap_failed error={}", CuName(ops, r));
      }
    }
    mapped.clear();
    if (base != 0) {
      if (const CUresult r = ops.free_range(base, reserved); r != CUDA_SUCCESS) {
        spdlog::warn("event=cuda_vmm_address_free_failed error={}", CuName(ops, r));
      }
      base = 0;
    }
    for (CUmemGenericAllocationHandle h : handles) {
      if (const CUresult r = ops.release(h); r != CUDA_SUCCESS) {
        spdlog::warn("event=cuda_vmm_release_failed error={}", CuName(ops, r));
      }
    }
    handles.clear();
  }
};

}  // namespace

tensor::CudaVmmOpener CudaDevice::cuda_vmm_opener() {
  return [this](std::span<const int> fds, std::span<const uint64_t> chunk_sizes, int32_t device_id,
                uint64_t offset, uint64_t byte_size) {
    return OpenVmmMemory(fds, chunk_sizes, device_id, offset, byte_size);
  };
}

absl::StatusOr<tensor::MappedMemory> CudaDevice::OpenVmmMemory(
    std::span<const int> fds, std::span<const uint64_t> chunk_sizes, int32_t device_id,
    uint64_t offset, uint64_t byte_size) {
  if (fds.size() != chunk_sizes.size() || fds.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda_vmm: %d descriptors for %d chunks", fds.size(), chunk_sizes.size()));
  }
  QTX_ASSIGN_OR_RETURN(const MemoryOps ops, GetMemoryOps());
  QTX_RETURN_IF_ERROR(Activate());
  const int count = VisibleCudaDevices();
  if (device_id < 0 || device_id >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda_vmm: device %d is not visible to qtxd (%d devices)", device_id, count));
  }
  if (device_id != ordinal_) {
    int can_access = 0;
    QTX_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can_access, ordinal_, device_id));
    if (!can_access) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "cuda_vmm: the memory is on cuda:%d (as qtxd numbers devices), which qtxd's cuda:%d "
          "cannot reach (no peer access); register it with the sidecar of that GPU",
          device_id, ordinal_));
    }
  }
  auto mapping = std::make_shared<VmmMapping>();
  mapping->ops = ops;
  mapping->ordinal = ordinal_;
  auto fail = [&](absl::Status s) {
    mapping->Release();
    return s;
  };
  uint64_t total = 0;
  size_t granularity = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    CUmemGenericAllocationHandle h = 0;
    const CUresult r =
        ops.import_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fds[i])),
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
      return fail(absl::InvalidArgumentError(absl::StrFormat(
          "cuda_vmm.chunks[%d]: its descriptor is not a CUDA memory handle qtxd can import "
          "(cuMemImportFromShareableHandle: %s); send what cuMemExportToShareableHandle("
          "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) returned",
          i, CuName(ops, r))));
    }
    mapping->handles.push_back(h);
    CUmemAllocationProp prop = {};
    if (const CUresult pr = ops.properties(&prop, h); pr != CUDA_SUCCESS) {
      return fail(absl::InternalError(absl::StrFormat(
          "cuda_vmm.chunks[%d]: cuMemGetAllocationPropertiesFromHandle: %s", i, CuName(ops, pr))));
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device_id) {
      return fail(absl::InvalidArgumentError(absl::StrFormat(
          "cuda_vmm.chunks[%d]: the memory is not on the GPU named by device_uuid (cuda:%d as "
          "qtxd numbers devices): its location is type %d id %d",
          i, device_id, static_cast<int>(prop.location.type), prop.location.id)));
    }
    if (i == 0) {
      if (const CUresult gr =
              ops.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
          gr != CUDA_SUCCESS || granularity == 0) {
        return fail(absl::InternalError(
            absl::StrFormat("cuda_vmm: cuMemGetAllocationGranularity: %s", CuName(ops, gr))));
      }
    }
    if (chunk_sizes[i] % granularity != 0) {
      return fail(absl::InvalidArgumentError(absl::StrFormat(
          "cuda_vmm.chunks[%d].size=%d: not a multiple of the allocation granularity %d (a "
          "chunk is a whole cuMemCreate allocation)",
          i, chunk_sizes[i], granularity)));
    }
    total += chunk_sizes[i];  // no overflow: RegionTable checked the sum
  }
  mapping->reserved = total;
  if (const CUresult r = ops.reserve(&mapping->base, total, granularity, 0, 0); r != CUDA_SUCCESS) {
    mapping->base = 0;
    return fail(absl::ResourceExhaustedError(absl::StrFormat(
        "cuda_vmm: cannot reserve %d bytes of address space: %s", total, CuName(ops, r))));
  }
  uint64_t at = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    const CUdeviceptr ptr = mapping->base + at;
    if (const CUresult r = ops.map(ptr, chunk_sizes[i], 0, mapping->handles[i], 0);
        r != CUDA_SUCCESS) {
      return fail(absl::InvalidArgumentError(absl::StrFormat(
          "cuda_vmm.chunks[%d].size=%d: cannot map it (cuMemMap: %s): the size must be the "
          "chunk's whole allocation, not more",
          i, chunk_sizes[i], CuName(ops, r))));
    }
    mapping->mapped.emplace_back(ptr, chunk_sizes[i]);
    at += chunk_sizes[i];
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (const CUresult r = ops.set_access(mapping->base, total, &access, 1); r != CUDA_SUCCESS) {
    return fail(absl::InternalError(
        absl::StrFormat("cuda_vmm: cuMemSetAccess for cuda:%d: %s", ordinal_, CuName(ops, r))));
  }
  tensor::MappedMemory memory;
  memory.data = reinterpret_cast<std::byte*>(mapping->base + offset);
  // As for CUDA IPC memory: work that returned early may still use it.
  memory.release = [this, mapping] {
    const absl::Status s = SynchronizeAll();
    if (!s.ok())
      spdlog::warn("event=cuda_vmm_release_sync_failed msg=\"{}\"", std::string(s.message()));
    mapping->Release();
  };
  spdlog::info("event=cuda_vmm_mapped device=cuda:{} chunks={} bytes={} granularity={}", ordinal_,
               fds.size(), total, granularity);
  (void)byte_size;  // bounds checked by the region table; the pins check slices
  return memory;
}

absl::StatusOr<tensor::MappedMemory> CudaDevice::OpenIpcMemory(std::string_view ipc_handle,
                                                               int32_t device_id,
                                                               uint64_t byte_size) {
  if (ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda_ipc.ipc_handle: %d bytes, must be exactly %d (a cudaIpcMemHandle_t)",
                        ipc_handle.size(), sizeof(cudaIpcMemHandle_t)));
  }
  QTX_RETURN_IF_ERROR(Activate());
  const int count = VisibleCudaDevices();
  if (device_id < 0 || device_id >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda_ipc.device_id=%d: this qtxd sees %d CUDA device(s) (ordinals are per process: "
        "check CUDA_VISIBLE_DEVICES on both sides)",
        device_id, count));
  }
  if (device_id != ordinal_) {
    int can_access = 0;
    QTX_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can_access, ordinal_, device_id));
    if (!can_access) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "cuda_ipc.device_id=%d: this qtxd computes on cuda:%d, which has no peer access to "
          "cuda:%d; register the memory with the sidecar of cuda:%d",
          device_id, ordinal_, device_id, device_id));
    }
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
  void* base = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    const absl::Status s = CudaErrorToStatus(err, "cudaIpcOpenMemHandle", __FILE__, __LINE__);
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda_ipc.ipc_handle (%s...): cannot open: %s (it must come from cudaIpcGetMemHandle on "
        "cudaMalloc memory of a live process on this machine, other than qtxd itself)",
        HexPrefix(ipc_handle), s.message()));
  }
  const int ordinal = ordinal_;
  auto close = [ordinal, base] {
    if (cudaSetDevice(ordinal) != cudaSuccess || cudaIpcCloseMemHandle(base) != cudaSuccess) {
      const cudaError_t e = cudaGetLastError();
      spdlog::warn("event=cuda_ipc_close_failed device=cuda:{} error={}", ordinal,
                   cudaGetErrorName(e));
    }
  };
  auto fail = [&](absl::Status s) {
    close();
    return s;
  };

  cudaPointerAttributes attr = {};
  const cudaError_t aerr = cudaPointerGetAttributes(&attr, base);
  if (aerr != cudaSuccess) {
    return fail(CudaErrorToStatus(aerr, "cudaPointerGetAttributes", __FILE__, __LINE__));
  }
  if (attr.type != cudaMemoryTypeDevice) {
    return fail(absl::InvalidArgumentError(
        absl::StrFormat("cuda_ipc.ipc_handle: the opened memory is not device memory (type %d)",
                        static_cast<int>(attr.type))));
  }
  if (attr.device != device_id) {
    return fail(absl::InvalidArgumentError(absl::StrFormat(
        "cuda_ipc.device_id=%d: the handle's memory is on cuda:%d (as this qtxd numbers devices)",
        device_id, attr.device)));
  }
  const absl::StatusOr<MemoryOps> memory_ops = GetMemoryOps();
  if (!memory_ops.ok()) return fail(memory_ops.status());
  CUdeviceptr alloc_base = 0;
  size_t alloc_size = 0;
  const CUresult rc =
      memory_ops->address_range(&alloc_base, &alloc_size, reinterpret_cast<CUdeviceptr>(base));
  if (rc != CUDA_SUCCESS) {
    return fail(absl::InternalError(
        absl::StrFormat("cuMemGetAddressRange on the opened IPC memory failed (CUresult %d)",
                        static_cast<int>(rc))));
  }
  const uint64_t start = reinterpret_cast<uintptr_t>(base);
  // Overflow-safe: bytes from the opened pointer to the allocation's end.
  const uint64_t available = start >= alloc_base && start - alloc_base <= alloc_size
                                 ? alloc_size - (start - alloc_base)
                                 : 0;
  if (byte_size > available) {
    return fail(absl::InvalidArgumentError(absl::StrFormat(
        "cuda_ipc.byte_size=%d exceeds the exported allocation: %d bytes from the handle's "
        "pointer to the end of its %d-byte allocation",
        byte_size, available, alloc_size)));
  }
  tensor::MappedMemory memory;
  memory.data = static_cast<std::byte*>(base);
  // A call that returned early (signal event) may still be using the memory:
  // drain the device's streams before unmapping.
  memory.release = [this, close] {
    const absl::Status s = SynchronizeAll();
    if (!s.ok())
      spdlog::warn("event=cuda_ipc_close_sync_failed msg=\"{}\"", std::string(s.message()));
    close();
  };
  return memory;
}

absl::StatusOr<cudaStream_t> CudaDevice::CurrentThreadStream() {
  QTX_RETURN_IF_ERROR(Activate());
  return ThisThreadStream();
}

absl::Status CudaDevice::SynchronizeAll() {
  QTX_RETURN_IF_ERROR(Activate());
  for (cudaStream_t s : streams_) QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  absl::MutexLock lock(&pipeline_mu_);
  for (cudaStream_t s : pipeline_streams_) QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

void CudaDevice::AddPipelineStreams(cudaStream_t a, cudaStream_t b) {
  absl::MutexLock lock(&pipeline_mu_);
  pipeline_streams_.push_back(a);
  pipeline_streams_.push_back(b);
}

void CudaDevice::RemovePipelineStreams(cudaStream_t a, cudaStream_t b) {
  absl::MutexLock lock(&pipeline_mu_);
  std::erase_if(pipeline_streams_, [&](cudaStream_t s) { return s == a || s == b; });
}

// ---- Stream-ordered channel queue ----

namespace {

// One channel's queue: a non-blocking stream of its own, on which the
// channel enqueues cuStreamWaitValue64(ready >= n), the op's kernels and
// cuStreamWriteValue64(done = n). Why the client sees the outputs when its
// wait on done is released: cuStreamWriteValue64 without
// CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER is preceded by a memory fence of
// the stream's scope (like __threadfence_system), and stream order puts it
// after the op's kernels have completed, so every output byte they stored is
// visible device-wide (and to other processes on the GPU, which share device
// memory through CUDA IPC) before the flag changes; the client's work behind
// its cuStreamWaitValue64 starts only after it observes the new value. The
// same argument orders the client's producer work before our wait on ready.
// Completion is tracked with events (blocking-sync: the completion thread
// sleeps) recorded after each OnDrained point.
class CudaChannelQueue final : public ChannelQueue {
 public:
  // `host_base`/`host_bytes`: the page range this queue registered with
  // cudaHostRegister for host-memory flags (unregistered on destruction),
  // empty otherwise.
  // `host_flags`: the flags' host address when they are host memory (then
  // Release is a host store), null for device flags.
  CudaChannelQueue(int ordinal, StreamMemOps ops, CUdeviceptr flags, void* host_base,
                   std::byte* host_flags)
      : ordinal_(ordinal),
        ops_(ops),
        ready_(flags),
        done_(flags + 8),
        host_base_(host_base),
        host_flags_(host_flags) {}

  absl::Status Init() {
    QTX_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    if (host_flags_ == nullptr) {
      QTX_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&release_stream_, cudaStreamNonBlocking));
    }
    // Not one of the device's streams for SynchronizeAll: it may wait on a
    // client for any time. The channel keeps the pins of the regions its
    // queued work uses until that work has completed instead.
    completion_ = std::thread([this] { CompletionLoop(); });
    return absl::OkStatus();
  }

  ~CudaChannelQueue() override {
    if (cudaSetDevice(ordinal_) != cudaSuccess) (void)cudaGetLastError();
    if (stream_ != nullptr && cudaStreamSynchronize(stream_) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (completion_.joinable()) completion_.join();
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    if (stream_ != nullptr) {
      (void)kernels::cuda::ForgetStreamTileCounter(stream_);  // drained above
      (void)cudaStreamDestroy(stream_);
    }
    if (release_stream_ != nullptr) (void)cudaStreamDestroy(release_stream_);
    if (host_base_ != nullptr) (void)cudaHostUnregister(host_base_);
    (void)cudaGetLastError();
  }

  cudaStream_t stream() const { return stream_; }

  absl::Status WaitReady(uint64_t seq) override {
    return DriverStatus(ops_.wait(stream_, ready_, seq, CU_STREAM_WAIT_VALUE_GEQ),
                        "cuStreamWaitValue64(ready)");
  }

  absl::Status WriteDone(uint64_t value) override {
    return DriverStatus(ops_.write(stream_, done_, value, CU_STREAM_WRITE_VALUE_DEFAULT),
                        "cuStreamWriteValue64(done)");
  }

  absl::Status OnDrained(std::function<void()> drained) override {
    QTX_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    cudaEvent_t event = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (!free_events_.empty()) {
        event = free_events_.back();
        free_events_.pop_back();
      }
    }
    if (event == nullptr) {
      QTX_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    }
    const cudaError_t err = cudaEventRecord(event, stream_);
    if (err != cudaSuccess) {
      (void)cudaEventDestroy(event);
      return CudaErrorToStatus(err, "cudaEventRecord", __FILE__, __LINE__);
    }
    absl::MutexLock lock(&mu_);
    pending_.push_back({event, std::move(drained)});
    return absl::OkStatus();
  }

  void Release() override {
    if (!released_.exchange(true)) {
      spdlog::debug("event=channel_release device=cuda:{} host_flags={}", ordinal_,
                    host_flags_ != nullptr);
    }
    // WaitReady compares (int64)(ready - seq) >= 0: a value 2^62 ahead of
    // the sequence numbers in use (< 2^62) releases all of them.
    constexpr uint64_t kReleaseValue = uint64_t{1} << 62;
    StoreFromHost(0, ready_, kReleaseValue);
  }

  void ReleaseClientWaits(uint64_t value) override {
    if (value != last_client_release_.exchange(value)) {
      spdlog::debug("event=channel_release_client_waits device=cuda:{} value={}", ordinal_, value);
    }
    StoreFromHost(8, done_, value);
  }

  std::string DescribeState() override {
    size_t awaited;
    {
      absl::MutexLock lock(&mu_);
      awaited = pending_.size() + (polling_ ? 1 : 0);
    }
    std::string words = "flags=device";
    if (host_flags_ != nullptr) {
      words =
          absl::StrFormat("ready=%d done=%d",
                          std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(host_flags_))
                              .load(std::memory_order_acquire),
                          std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(host_flags_ + 8))
                              .load(std::memory_order_acquire));
    }
    return absl::StrFormat("%s released=%s completions_awaited=%d", words,
                           released_.load() ? "yes" : "no", awaited);
  }

 private:
  struct Pending {
    cudaEvent_t event;
    std::function<void()> drained;
  };

  // Stores `value` into the flag word at byte `offset` (device address
  // `word`), not in the channel stream's order: a host store for host flags,
  // else a write from a stream of our own (the channel stream may be parked).
  void StoreFromHost(uint64_t offset, CUdeviceptr word, uint64_t value) {
    if (host_flags_ != nullptr) {
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(host_flags_ + offset))
          .store(value, std::memory_order_release);
      return;
    }
    if (cudaSetDevice(ordinal_) != cudaSuccess ||
        ops_.write(release_stream_, word, value, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS ||
        cudaStreamSynchronize(release_stream_) != cudaSuccess) {
      (void)cudaGetLastError();
      spdlog::warn("event=channel_flag_store_failed device=cuda:{} offset={}", ordinal_, offset);
    }
  }

  // Reports completions in order. Polls each event with cudaEventQuery (5 us
  // growing to 1 ms between looks; a blocking-sync wait would hold a lock of
  // the runtime the submission path needs). Off the submission path.
  void CompletionLoop() {
    if (cudaSetDevice(ordinal_) != cudaSuccess) (void)cudaGetLastError();
    for (;;) {
      Pending p;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](CudaChannelQueue* q)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return q->stopping_ || !q->pending_.empty(); },
            this));
        if (pending_.empty()) return;  // stopping, nothing left
        p = std::move(pending_.front());
        pending_.pop_front();
        polling_ = true;
      }
      absl::Duration nap = absl::Microseconds(5);
      cudaError_t q;
      while ((q = cudaEventQuery(p.event)) == cudaErrorNotReady) {
        absl::SleepFor(nap);
        nap = std::min(nap * 2, absl::Milliseconds(1));
      }
      if (q != cudaSuccess) (void)cudaGetLastError();
      p.drained();
      absl::MutexLock lock(&mu_);
      polling_ = false;
      free_events_.push_back(p.event);
    }
  }

  // Constant after Init().
  const int ordinal_;
  const StreamMemOps ops_;
  const CUdeviceptr ready_;
  const CUdeviceptr done_;
  void* const host_base_;
  std::byte* const host_flags_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t release_stream_ = nullptr;
  std::thread completion_;
  std::atomic<bool> released_{false};
  std::atomic<uint64_t> last_client_release_{0};  // for the log

  // State below is protected by mu_.
  absl::Mutex mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> free_events_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool polling_ ABSL_GUARDED_BY(mu_) = false;  // an event taken from pending_ is not done yet
};

}  // namespace

absl::StatusOr<std::unique_ptr<ChannelQueue>> CudaDevice::OpenChannelQueue(
    std::byte* flags, tensor::MemoryKind flags_kind) {
  QTX_RETURN_IF_ERROR(Activate());
  QTX_ASSIGN_OR_RETURN(const StreamMemOps ops, GetStreamMemOps());
  int supported = 0;
  QTX_RETURN_IF_ERROR(DriverStatus(
      ops.get_attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, ordinal_),
      "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS)"));
  if (supported == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda:%d does not support 64-bit stream memory operations (needed by channels)", ordinal_));
  }
  CUdeviceptr words = reinterpret_cast<CUdeviceptr>(flags);
  void* host_base = nullptr;
  if (flags_kind == tensor::MemoryKind::kHost) {
    // Host flags (a client's shm): map their page(s) for the GPU. They outlive
    // either process (the shm object stays while one maps it), so neither
    // side's stream ever waits on or writes freed memory.
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(flags) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(flags) + 16 + page - 1) / page * page;
    const cudaError_t err = cudaHostRegister(reinterpret_cast<void*>(begin), end - begin,
                                             cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();
    } else if (err != cudaSuccess) {
      return CudaErrorToStatus(err, "cudaHostRegister(channel flags)", __FILE__, __LINE__);
    } else {
      host_base = reinterpret_cast<void*>(begin);
    }
    void* device_view = nullptr;
    const cudaError_t gerr = cudaHostGetDevicePointer(&device_view, flags, 0);
    if (gerr != cudaSuccess) {
      if (host_base != nullptr) (void)cudaHostUnregister(host_base);
      return CudaErrorToStatus(gerr, "cudaHostGetDevicePointer(channel flags)", __FILE__, __LINE__);
    }
    words = reinterpret_cast<CUdeviceptr>(device_view);
  }
  auto queue = std::make_unique<CudaChannelQueue>(
      ordinal_, ops, words, host_base, flags_kind == tensor::MemoryKind::kHost ? flags : nullptr);
  QTX_RETURN_IF_ERROR(queue->Init());
  return queue;
}

cudaStream_t CudaDevice::QueueStream(ChannelQueue* queue) {
  return static_cast<CudaChannelQueue*>(queue)->stream();
}

// ---- Transfer pipeline (D2H inbound, H2D outbound, pinned staging) ----

namespace {

class CudaTransferPipeline final : public TransferPipeline {
 public:
  CudaTransferPipeline(CudaDevice* device, int ordinal) : device_(device), ordinal_(ordinal) {}

  absl::Status Init() {
    QTX_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&inbound_, cudaStreamNonBlocking));
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&outbound_, cudaStreamNonBlocking));
    device_->AddPipelineStreams(inbound_, outbound_);
    registered_ = true;
    return absl::OkStatus();
  }

  ~CudaTransferPipeline() override {
    if (cudaSetDevice(ordinal_) != cudaSuccess) (void)cudaGetLastError();
    for (cudaStream_t s : {inbound_, outbound_}) {
      if (s != nullptr && cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
    }
    if (registered_) device_->RemovePipelineStreams(inbound_, outbound_);
    for (cudaEvent_t e : inbound_done_) (void)cudaEventDestroy(e);
    if (staging_ != nullptr) (void)cudaFreeHost(staging_);
    for (cudaStream_t s : {inbound_, outbound_}) {
      if (s == nullptr) continue;
      (void)kernels::cuda::ForgetStreamTileCounter(s);  // synchronized above
      (void)cudaStreamDestroy(s);
    }
    (void)cudaGetLastError();
  }

  absl::StatusOr<std::byte*> Staging(uint64_t bytes) override {
    if (bytes <= staging_bytes_ && staging_ != nullptr) return staging_;
    QTX_RETURN_IF_ERROR(Drain());
    if (staging_ != nullptr) QTX_CUDA_RETURN_IF_ERROR(cudaFreeHost(staging_));
    staging_ = nullptr;
    staging_bytes_ = 0;
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, std::max<uint64_t>(bytes, 1), cudaHostAllocDefault);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrFormat("cuda:%d: cannot allocate %d bytes of page-locked host staging: %s",
                          ordinal_, bytes, cudaGetErrorString(err)));
    }
    staging_ = static_cast<std::byte*>(p);
    staging_bytes_ = bytes;
    return staging_;
  }

  uint64_t staging_bytes() const override { return staging_bytes_; }

  absl::Status Begin(const CudaEvents& events) override {
    QTX_RETURN_IF_ERROR(Drain());
    signal_ = nullptr;
    tickets_ = 0;
    if (!events.signal_event.empty()) {
      QTX_ASSIGN_OR_RETURN(signal_,
                           device_->OpenEvent(events.signal_event, "cuda_events.signal_event"));
    }
    if (!events.wait_event.empty()) {
      QTX_ASSIGN_OR_RETURN(std::shared_ptr<CUevent_st> wait,
                           device_->OpenEvent(events.wait_event, "cuda_events.wait_event"));
      QTX_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(inbound_, wait.get(), 0));
      QTX_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(outbound_, wait.get(), 0));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int> CopyToHostAsync(void* host_dst, const void* device_src,
                                      uint64_t bytes) override {
    const int ticket = tickets_;
    if (static_cast<size_t>(ticket) == inbound_done_.size()) {
      cudaEvent_t e = nullptr;
      QTX_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      inbound_done_.push_back(e);
    }
    if (bytes > 0) {
      QTX_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, inbound_));
    }
    QTX_CUDA_RETURN_IF_ERROR(cudaEventRecord(inbound_done_[ticket], inbound_));
    ++tickets_;
    return ticket;
  }

  absl::Status WaitInbound(int ticket) override {
    if (ticket < 0 || ticket >= tickets_) {
      return absl::InternalError(absl::StrFormat("WaitInbound: ticket %d of %d", ticket, tickets_));
    }
    QTX_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(inbound_done_[ticket]));
    return absl::OkStatus();
  }

  absl::Status CopyFromHostAsync(void* device_dst, const void* host_src, uint64_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    QTX_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, outbound_));
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    if (signal_ != nullptr) {
      QTX_CUDA_RETURN_IF_ERROR(cudaEventRecord(signal_.get(), outbound_));
      signal_ = nullptr;
      return absl::OkStatus();
    }
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(outbound_));
    return absl::OkStatus();
  }

  absl::Status Drain() override {
    QTX_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(inbound_));
    QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(outbound_));
    return absl::OkStatus();
  }

 private:
  // Constant after Init().
  CudaDevice* const device_;
  const int ordinal_;
  cudaStream_t inbound_ = nullptr;
  cudaStream_t outbound_ = nullptr;
  bool registered_ = false;

  // One user at a time (see TransferPipeline).
  std::byte* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
  std::vector<cudaEvent_t> inbound_done_;  // reused across calls
  int tickets_ = 0;
  std::shared_ptr<CUevent_st> signal_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TransferPipeline>> CudaDevice::CreateTransferPipeline() {
  auto pipeline = std::make_unique<CudaTransferPipeline>(this, ordinal_);
  QTX_RETURN_IF_ERROR(pipeline->Init());
  return pipeline;
}

absl::StatusOr<std::shared_ptr<CUevent_st>> CudaDevice::OpenEvent(std::string_view handle,
                                                                  std::string_view field) {
  return OpenIpcEvent(handle, field);
}

}  // namespace qtx::server::backend

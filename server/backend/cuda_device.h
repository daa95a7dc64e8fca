// CudaDevice: the Device on one CUDA GPU ("cuda:N"), running kernels/cuda.
//
// Memory: device buffers come from a CUDA memory pool of its own (stream-
// ordered cudaMallocFromPoolAsync / cudaFreeAsync) that keeps freed memory
// cached up to a release threshold. Host <-> device copies go through pinned
// staging buffers in fixed-size chunks (double-buffered), so pageable request
// bytes (inline tensors, shm mappings) never block on a pageable DMA.
//
// Streams: a pool of non-blocking streams. A calling thread always gets the
// same stream ("this thread's stream"), so the Allocate -> CopyFromHost ->
// Quantize -> CopyToHost sequence of one request, which runs on one executor
// thread, is stream-ordered without extra synchronization.
//
// CUDA IPC: cuda_ipc_opener() opens a client's cudaIpcMemHandle_t once, at
// registration, after checking the handle against the real allocation; the
// mapping is closed (after the device's streams drain) when the region's last
// pin drops. cuda_vmm_opener() imports cuMemCreate chunks passed as POSIX
// file descriptors and maps them contiguously; qtxd then holds the physical
// memory itself (see OpenVmmMemory). Interprocess events (CudaEvents in the op arguments) are
// opened on first use and cached by handle.
//
// Thread safety: safe for concurrent use by any number of threads.
#ifndef QTX_SERVER_BACKEND_CUDA_DEVICE_H_
#define QTX_SERVER_BACKEND_CUDA_DEVICE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/device.h"

namespace qtx::server::backend {

struct CudaDeviceOptions {
  // Streams in the pool (>= 1); threads beyond this share streams.
  int streams = 8;
  // Bytes of freed pool memory kept cached instead of returned to the driver
  // at a synchronization point. UINT64_MAX: keep everything.
  uint64_t pool_release_threshold = UINT64_MAX;
  // Size of each of the two pinned staging buffers of one copy (>= 4096).
  uint64_t staging_chunk_bytes = uint64_t{8} << 20;
  // Opened interprocess events kept (least recently opened evicted first).
  size_t max_cached_events = 1024;
};

// Number of CUDA devices this process sees; 0 when there is no driver or no
// device (the error is cleared, never raised).
int VisibleCudaDevices();

class CudaDevice final : public Device {
 public:
  // Creates the device for ordinal `ordinal`. INVALID_ARGUMENT for a bad
  // option; FAILED_PRECONDITION when the host cannot run CUDA at all (no
  // driver, no GPU, driver too old); NOT_FOUND when no such device is visible
  // (the message gives the count); INTERNAL for other CUDA failures.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(int ordinal,
                                                            const CudaDeviceOptions& options = {});
  // Waits for the streams, then releases streams, events, staging and pool.
  // REQUIRES: no DeviceBuffer from Allocate and no region opened through
  // cuda_ipc_opener() outlives the device.
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  int ordinal() const { return ordinal_; }
  std::string name() const override;
  tensor::MemoryKind memory_kind() const override { return tensor::MemoryKind::kDevice; }

  // Stream-ordered on this thread's stream: usable by later work on it at
  // once; freed (cudaFreeAsync) on the same stream when the buffer dies.
  // RESOURCE_EXHAUSTED when the pool cannot grow.
  absl::StatusOr<DeviceBuffer> Allocate(uint64_t bytes) override;

  // Chunked through pinned staging buffers on this thread's stream, ordered
  // after the work already queued there. Return when the copy is done.
  absl::Status CopyFromHost(void* device_dst, const void* host_src, uint64_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* device_src, uint64_t bytes) override;

  // Enqueue on this thread's stream: wait on args.events.wait_event (if set),
  // the kernel, record args.events.signal_event (if set). Without a signal
  // event the call returns when the outputs are written; with one it returns
  // once the work is enqueued. INVALID_ARGUMENT for an event handle that is
  // not 64 bytes or cannot be opened; INTERNAL on a CUDA failure.
  absl::Status Quantize(const QuantizeArgs& args) override;
  absl::Status Dequantize(const DequantizeArgs& args) override;

  // The exact all-gather building blocks (kernels/cuda/quantize_shard.h) on
  // this thread's stream; each returns when its outputs are written.
  absl::Status ShardBoundaryAmax(const ShardArgs& args, float* first, float* last) override;
  absl::Status QuantizeShard(const ShardArgs& args, const float* first_amax, const float* last_amax,
                             const kernels::QuantizedBuffers& out) override;
  absl::Status OrderAfterClient(const CudaEvents& events) override;
  absl::Status SignalClient(const CudaEvents& events) override;
  absl::Status CombineBoundaryAmax(int world_size, const kernels::ShardGeometry* geoms,
                                   const float* gathered, int64_t len, int rank,
                                   kernels::BlockScaling scaling, float* first_out,
                                   float* last_out) override;
  absl::Status CopyOnDevice(void* dst, const void* src, uint64_t bytes) override;
  absl::Status SynchronizeThisThread() override;
  // Mapped page-locked memory (cudaHostAlloc, portable and mapped), kept in
  // a pool of power-of-two blocks: a dead buffer goes back to the pool from
  // a host function enqueued on this thread's stream (stream order, no wait).
  absl::StatusOr<DeviceBuffer> AllocateHostVisible(uint64_t bytes) override;
  // kernels/cuda/slot_check.h on this thread's stream.
  absl::Status CheckSlotHeaders(const SlotHeaderCheck& args) override;
  absl::Status AssembleShards(int world_size, const kernels::ShardGeometry* geoms,
                              const kernels::QuantizedConstBuffers* shards,
                              const kernels::QuantizeParams& params,
                              const kernels::QuantizedBuffers& out) override;

  tensor::CudaIpcOpener cuda_ipc_opener() override;
  tensor::CudaVmmOpener cuda_vmm_opener() override;
  // Finds the visible GPU whose cudaDeviceProp::uuid is the 16 bytes given.
  tensor::CudaUuidResolver cuda_uuid_resolver() override;

  // A channel queue on a non-blocking stream of its own (not counted in
  // SynchronizeAll: the channel pins what its queued work uses), ordered through
  // cuStreamWaitValue64 / cuStreamWriteValue64 on `flags`: host memory (a client's shm, registered
  // with cudaHostRegister here; the default of qtx::cuda::OpenChannel) or
  // device memory (a client's CUDA IPC region). FAILED_PRECONDITION when the
  // driver or GPU lacks 64-bit stream memory operations; INTERNAL on a CUDA
  // failure.
  absl::StatusOr<std::unique_ptr<ChannelQueue>> OpenChannelQueue(
      std::byte* flags, tensor::MemoryKind flags_kind) override;

  // A pipeline with two non-blocking streams of its own (inbound D2H,
  // outbound H2D), one reusable event per inbound copy, and cudaHostAlloc
  // staging. Its streams count as the device's streams for SynchronizeAll (so
  // a CUDA IPC region is unmapped only after its copies). INTERNAL on a CUDA
  // failure.
  absl::StatusOr<std::unique_ptr<TransferPipeline>> CreateTransferPipeline() override;

  // Opens a cudaIpcMemHandle_t exported by another process for device
  // `device_id` and checks that `byte_size` bytes from the exported pointer
  // lie inside the real allocation. INVALID_ARGUMENT for a handle that is not
  // 64 bytes or cannot be opened, a device_id that is not visible or not the
  // device the memory is on, or a byte_size beyond the allocation;
  // FAILED_PRECONDITION when memory on device_id is not reachable from this
  // device (no peer access). The returned release closes the mapping after
  // the device's streams drain.
  absl::StatusOr<tensor::MappedMemory> OpenIpcMemory(std::string_view ipc_handle, int32_t device_id,
                                                     uint64_t byte_size);

  // Imports cuMemCreate chunks from POSIX fd handles (borrowed), checks that
  // each lives on `device_id`, reserves one address range, maps chunk i at
  // the sum of the sizes before it and makes it readable and writable from
  // this device. Returns [offset, offset + byte_size) of the range. The
  // imported handles keep the physical memory alive whatever the exporting
  // process does (frees it, dies); the returned release waits for the
  // device's streams, then unmaps and releases everything.
  // INVALID_ARGUMENT for a descriptor that is not a CUDA memory handle
  // (naming the chunk), a chunk size that is not a multiple of the
  // granularity or larger than its allocation, memory on another GPU;
  // FAILED_PRECONDITION when device_id is not reachable from this device;
  // RESOURCE_EXHAUSTED when no address range can be reserved.
  absl::StatusOr<tensor::MappedMemory> OpenVmmMemory(std::span<const int> fds,
                                                     std::span<const uint64_t> chunk_sizes,
                                                     int32_t device_id, uint64_t offset,
                                                     uint64_t byte_size);

  // The calling thread's stream (see Streams above) with this device made
  // current on the thread: a device communicator (NCCL) orders its work on
  // it, after this thread's kernels and copies. INTERNAL on a CUDA failure.
  absl::StatusOr<cudaStream_t> CurrentThreadStream();

  // Blocks until all work queued on every stream of the device (the pool's
  // and every live transfer pipeline's) is done.
  absl::Status SynchronizeAll();

  // Opens (or finds cached) the interprocess event with the 64-byte handle;
  // INVALID_ARGUMENT naming `field` when it cannot be opened.
  absl::StatusOr<std::shared_ptr<CUevent_st>> OpenEvent(std::string_view handle,
                                                        std::string_view field);

  // Transfer pipelines add and remove their streams here.
  void AddPipelineStreams(cudaStream_t a, cudaStream_t b);
  void RemovePipelineStreams(cudaStream_t a, cudaStream_t b);

 private:
  struct StagingPair {
    void* host[2] = {nullptr, nullptr};  // pinned, staging_chunk_bytes each
    cudaEvent_t done[2] = {nullptr, nullptr};
  };
  // An opened interprocess event; destroyed when the last holder drops it.
  using SharedEvent = std::shared_ptr<CUevent_st>;

  CudaDevice(int ordinal, const CudaDeviceOptions& options);
  absl::Status Init();

  // The stream of a queue from OpenChannelQueue.
  static cudaStream_t QueueStream(ChannelQueue* queue);
  // Enqueues on `waiter` a wait for the work enqueued on `producer` so far.
  static absl::Status StreamWaitsForStream(cudaStream_t waiter, cudaStream_t producer);

  // Makes ordinal_ the calling thread's current device.
  absl::Status Activate() const;
  cudaStream_t ThisThreadStream() const;

  absl::StatusOr<StagingPair*> AcquireStaging();
  void ReleaseStaging(StagingPair* pair);

  absl::StatusOr<SharedEvent> OpenIpcEvent(std::string_view handle, std::string_view field);
  // Records events.signal_event on `stream`, or synchronizes `stream`.
  absl::Status FinishOp(const CudaEvents& events, cudaStream_t stream);

  // Constant after Init().
  const int ordinal_;
  const CudaDeviceOptions options_;
  std::vector<cudaStream_t> streams_;
  cudaMemPool_t pool_ = nullptr;

  // State below is protected by mu_.
  absl::Mutex mu_;
  std::vector<std::unique_ptr<StagingPair>> staging_all_ ABSL_GUARDED_BY(mu_);
  std::vector<StagingPair*> staging_free_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, SharedEvent, std::less<>> events_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> event_order_ ABSL_GUARDED_BY(mu_);  // oldest first
  // AllocateHostVisible's free blocks by size (cudaFreeHost on destruction).
  std::multimap<uint64_t, void*> host_visible_free_ ABSL_GUARDED_BY(mu_);

  // Streams of live transfer pipelines. Held while synchronizing them, so a
  // pipeline cannot destroy a stream SynchronizeAll is waiting on.
  absl::Mutex pipeline_mu_;
  std::vector<cudaStream_t> pipeline_streams_ ABSL_GUARDED_BY(pipeline_mu_);
};

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_CUDA_DEVICE_H_

#include "qtx/cuda_channel.h"

#include <cuda.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_driver.h"
#include "cuda_status.h"
#include "qtx/cuda_ipc.h"
#include "qtx/shm_region.h"
#include "stream_flags.h"

namespace qtx::cuda {
namespace {

using internal::CudaStatus;

using cuda_driver::DriverStatus;
using cuda_driver::GetStreamMemOps;
using cuda_driver::StreamMemOps;

// The flag words, ready at +0 and done at +8, seen by the GPU at `words` and
// (host flags) by this host at `host`. Owns the memory behind them.
class StreamFlags final : public ChannelFlags {
 public:
  StreamFlags(Client& client, StreamMemOps ops, cudaStream_t stream, int device, CUdeviceptr words,
              std::string region, std::unique_ptr<ShmRegion> shm, void* device_alloc)
      : client_(client),
        ops_(ops),
        stream_(stream),
        device_(device),
        words_(words),
        region_(std::move(region)),
        shm_(std::move(shm)),
        device_alloc_(device_alloc) {}

  ~StreamFlags() override {
    (void)client_.UnregisterRegion(region_);
    int current = 0;
    const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    // Nothing of `stream_` may still touch the words when they go (its waits
    // were released if qtxd went away).
    (void)cudaStreamSynchronize(stream_);
    if (shm_ != nullptr) (void)cudaHostUnregister(shm_->data());
    if (device_alloc_ != nullptr) (void)cudaFree(device_alloc_);
    if (release_stream_ != nullptr) (void)cudaStreamDestroy(release_stream_);
    if (switched) (void)cudaSetDevice(current);
    (void)cudaGetLastError();
  }

  absl::Status Init() {
    const cudaError_t err = cudaStreamCreateWithFlags(&release_stream_, cudaStreamNonBlocking);
    if (err != cudaSuccess) return CudaStatus(err, "cudaStreamCreateWithFlags");
    return absl::OkStatus();
  }

  RegionSlice slice() const override { return RegionSlice{region_, 0, 16}; }
  // The words as the GPU sees them: ready, done, then 8 more zeroed bytes.
  CUdeviceptr words() const { return words_; }

  absl::Status SignalReady(uint64_t seq) override {
    // Default flags: a memory fence precedes the write, so qtxd, released by
    // it, sees everything this stream wrote before.
    return DriverStatus(ops_.write(stream_, words_, seq, CU_STREAM_WRITE_VALUE_DEFAULT),
                        "cuStreamWriteValue64(ready)");
  }

  absl::Status WaitDone(uint64_t seq) override {
    return DriverStatus(ops_.wait(stream_, words_ + 8, seq, CU_STREAM_WAIT_VALUE_GEQ),
                        "cuStreamWaitValue64(done)");
  }

  void ReleaseWaits(bool sidecar_gone) override {
    if (shm_ != nullptr) {
      // Host stores: stream waits (cuStreamWaitValue64) poll this page.
      // ready first, so that a reader who sees the released done also sees
      // the released ready.
      uint64_t* words = reinterpret_cast<uint64_t*>(shm_->data());
      if (sidecar_gone) {
        std::atomic_ref<uint64_t>(words[0]).store(kChannelReleaseAll, std::memory_order_release);
      }
      std::atomic_ref<uint64_t>(words[1]).store(kChannelReleaseAll, std::memory_order_release);
    }
    // The same words written by the GPU, from a private stream (`stream_` may
    // be parked on the wait itself). Needed for host flags too: a plan's
    // kernel spins on done with system-scope loads, and on the H200 a store
    // from this host never reached a kernel already spinning on the page
    // (CudaPlanTest.QtxdDyingReleasesReplaysForGood, 2026-12-01), while
    // writes made by the GPU (qtxd's, and these) do.
    int current = 0;
    const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    bool ok = !sidecar_gone || ops_.write(release_stream_, words_, kChannelReleaseAll,
                                          CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS;
    ok = ok && ops_.write(release_stream_, words_ + 8, kChannelReleaseAll,
                          CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS;
    if (!ok || cudaStreamSynchronize(release_stream_) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    if (switched) (void)cudaSetDevice(current);
  }

 private:
  Client& client_;
  const StreamMemOps ops_;
  const cudaStream_t stream_;
  const int device_;
  const CUdeviceptr words_;
  const std::string region_;
  const std::unique_ptr<ShmRegion> shm_;
  void* const device_alloc_;
  cudaStream_t release_stream_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ChannelFlags>> CreateStreamFlags(Client& client, cudaStream_t stream,
                                                                FlagMemory memory) {
  CUdeviceptr words = 0;
  return internal::CreateFlags(client, stream, memory, &words);
}

namespace internal {

absl::StatusOr<std::unique_ptr<ChannelFlags>> CreateFlags(Client& client, cudaStream_t stream,
                                                          FlagMemory memory,
                                                          CUdeviceptr* device_words) {
  absl::StatusOr<StreamMemOps> ops = GetStreamMemOps();
  if (!ops.ok()) return ops.status();
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return CudaStatus(err, "cudaGetDevice");
  int supported = 0;
  if (absl::Status s = DriverStatus(
          ops->get_attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device),
          "cuDeviceGetAttribute");
      !s.ok()) {
    return s;
  }
  if (supported == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda:%d does not support 64-bit stream memory operations (needed by channels)", device));
  }
  static std::atomic<uint64_t> counter{0};
  std::string region = absl::StrFormat("qtx-channel-%d-%d", ::getpid(),
                                       counter.fetch_add(1, std::memory_order_relaxed));
  std::unique_ptr<StreamFlags> flags;
  if (memory == FlagMemory::kHostShm) {
    // One zero-filled page of shm, mapped for the GPU here; qtxd maps it too.
    absl::StatusOr<std::unique_ptr<ShmRegion>> shm = ShmRegion::Create(region, 4096);
    if (!shm.ok()) return shm.status();
    err = cudaHostRegister((*shm)->data(), 4096, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (err != cudaSuccess) return CudaStatus(err, "cudaHostRegister(channel flags)");
    void* view = nullptr;
    err = cudaHostGetDevicePointer(&view, (*shm)->data(), 0);
    if (err != cudaSuccess) {
      (void)cudaHostUnregister((*shm)->data());
      return CudaStatus(err, "cudaHostGetDevicePointer(channel flags)");
    }
    if (absl::Status s = client.RegisterShmRegion(**shm); !s.ok()) {
      (void)cudaHostUnregister((*shm)->data());
      return absl::Status(s.code(), absl::StrCat("channel flags in client shm: ", s.message()));
    }
    flags = std::make_unique<StreamFlags>(client, *ops, stream, device,
                                          reinterpret_cast<CUdeviceptr>(view), region,
                                          std::move(*shm), nullptr);
  } else {
    // Its own allocation (cudaIpcGetMemHandle exports whole allocations),
    // zeroed before any stream can see it.
    void* words = nullptr;
    err = cudaMalloc(&words, 256);
    if (err != cudaSuccess) return CudaStatus(err, "cudaMalloc(channel flags)");
    err = cudaMemset(words, 0, 256);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      (void)cudaFree(words);
      return CudaStatus(err, "cudaMemset(channel flags)");
    }
    if (absl::Status s = RegisterDevicePointer(client, region, words, 256); !s.ok()) {
      (void)cudaFree(words);
      return s;
    }
    flags = std::make_unique<StreamFlags>(
        client, *ops, stream, device, reinterpret_cast<CUdeviceptr>(words), region, nullptr, words);
  }
  if (absl::Status s = flags->Init(); !s.ok()) return s;
  *device_words = flags->words();
  return flags;
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<Channel>> OpenChannel(Client& client, cudaStream_t stream,
                                                     const ChannelOptions& options,
                                                     FlagMemory memory) {
  absl::StatusOr<std::unique_ptr<ChannelFlags>> flags = CreateStreamFlags(client, stream, memory);
  if (!flags.ok()) return flags.status();
  return Channel::Open(client, std::move(*flags), options);
}

}  // namespace qtx::cuda

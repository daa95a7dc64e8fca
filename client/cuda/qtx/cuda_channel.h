// qtx::cuda::OpenChannel: a qtx::Channel (qtx/channel.h) bound to a CUDA
// stream of the caller, for a CUDA sidecar on the same GPU.
//
//   auto ch = qtx::cuda::OpenChannel(*client, stream, {.label = "tp0"});
//   // per layer, no host wait:
//   produce<<<..., stream>>>(x);                 // writes the input region
//   (*ch)->Quantize(x_slice, cfg, out_slices);   // ready = n; submit; wait done >= n
//   gemm<<<..., stream>>>(out);                  // runs after the outputs exist
//
// The flag area (FlagMemory::kHostShm, the default) is 16 bytes of a POSIX
// shm object of this process, mapped for the GPU in both processes
// (cudaHostRegister) and registered with qtxd (which needs
// --allow_client_shm); "ready = n" is a cuStreamWriteValue64 on `stream`,
// "wait done >= n" a cuStreamWaitValue64 on it. Both are stream operations:
// they can be captured in a CUDA graph (the submission itself, a host call,
// cannot; see client/README.md). Shared host memory outlives whichever
// process dies first, so neither side's stream ever waits on or writes
// freed memory (under MPS such a fault tears down every process on the
// GPU), and this process can always release its own waits with a host store
// (qtxd gone: done = kChannelReleaseAll).
//
// FlagMemory::kDevice puts the flags in this process's device memory
// (cudaMalloc, CUDA IPC) instead: no --allow_client_shm needed, but if this
// process dies with work parked on them under MPS, the GPU's other processes
// are torn down with it. For measurements and MPS-free setups.
//
// Needs MPS on one GPU for speed: without it the two processes' contexts
// time-slice and each hand-off costs about a millisecond.
//
// Lazy module loading: while `stream` waits for qtxd, a first launch of a
// kernel of this process that is not loaded yet stalls until the wait is
// released (the load waits for the context). Set CUDA_MODULE_LOADING=EAGER
// in the training process, or launch each kernel once before the first
// channel call.
#ifndef QTX_CLIENT_CUDA_QTX_CUDA_CHANNEL_H_
#define QTX_CLIENT_CUDA_QTX_CUDA_CHANNEL_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "qtx/channel.h"
#include "qtx/client.h"

namespace qtx::cuda {

enum class FlagMemory {
  kHostShm,  // shared host memory (the default; see above)
  kDevice,   // this process's device memory through CUDA IPC
};

// Flags for the current device, ordered on `stream`. FAILED_PRECONDITION
// when the driver or GPU lacks 64-bit stream memory operations, or (kHostShm)
// when qtxd does not allow client shm; INTERNAL on CUDA errors; the server's
// status when the flag region cannot be registered.
absl::StatusOr<std::unique_ptr<ChannelFlags>> CreateStreamFlags(
    Client& client, cudaStream_t stream, FlagMemory memory = FlagMemory::kHostShm);

// CreateStreamFlags + Channel::Open.
absl::StatusOr<std::unique_ptr<Channel>> OpenChannel(Client& client, cudaStream_t stream,
                                                     const ChannelOptions& options = {},
                                                     FlagMemory memory = FlagMemory::kHostShm);

}  // namespace qtx::cuda

#endif  // QTX_CLIENT_CUDA_QTX_CUDA_CHANNEL_H_

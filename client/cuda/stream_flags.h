// Internal to qtx_client_cuda: the flag areas behind qtx::cuda channels and
// plans.
#ifndef QTX_CLIENT_CUDA_STREAM_FLAGS_H_
#define QTX_CLIENT_CUDA_STREAM_FLAGS_H_

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/cuda_channel.h"

namespace qtx::cuda::internal {

// CreateStreamFlags, also giving the GPU address of the words: ready at +0,
// done at +8, and 8 zeroed bytes at +16 that qtxd never reads (a plan's
// execution counter).
absl::StatusOr<std::unique_ptr<ChannelFlags>> CreateFlags(Client& client, cudaStream_t stream,
                                                          FlagMemory memory,
                                                          CUdeviceptr* device_words);

}  // namespace qtx::cuda::internal

#endif  // QTX_CLIENT_CUDA_STREAM_FLAGS_H_

#include "qtx/cuda_plan.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "cuda_status.h"
#include "plan_kernel.h"
#include "stream_flags.h"

namespace qtx::cuda {

absl::StatusOr<std::unique_ptr<Plan>> Plan::Open(Client& client, const PlanOp& op,
                                                 const PlanOptions& options) {
  int device = 0;  // only checked: a plan needs a current device
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return internal::CudaStatus(err, "cudaGetDevice");
  CUdeviceptr words = 0;
  // The flags are never used through a stream here (the kernel moves them);
  // the stream given is only what their destructor synchronizes: the caller
  // has finished its replays before Close (cuda_plan.h).
  absl::StatusOr<std::unique_ptr<ChannelFlags>> flags =
      internal::CreateFlags(client, cudaStreamPerThread, options.memory, &words);
  if (!flags.ok()) return flags.status();
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      Channel::OpenPlan(client, std::move(*flags), op, options.channel, options.lookahead);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<Plan>(
      new Plan(std::move(*channel), reinterpret_cast<unsigned long long*>(words)));
}

Plan::~Plan() { (void)Close(); }

absl::Status Plan::Enqueue(cudaStream_t stream) {
  if (absl::Status s = channel_->status(); !s.ok()) return s;
  const cudaError_t err = internal::LaunchPlanStep(stream, words_);
  if (err != cudaSuccess) return internal::CudaStatus(err, "plan step kernel launch");
  return absl::OkStatus();
}

absl::Status Plan::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  const absl::Status failure = channel_->status();
  const absl::Status closed = channel_->Close();
  return failure.ok() ? closed : failure;
}

}  // namespace qtx::cuda

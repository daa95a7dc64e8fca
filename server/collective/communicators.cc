#include "server/collective/communicators.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/backend/gloo_communicator.h"

#if defined(QTX_HAVE_NCCL) && defined(QTX_HAVE_CUDA_DEVICE)
#include "server/backend/cuda_device.h"
#include "server/backend/nccl_communicator.h"
#define QTX_NCCL_WIRING 1
#endif

namespace qtx::server::collective {

CommunicatorFactory GlooCommunicatorFactory(std::string peer_host) {
  return
      [peer_host = std::move(peer_host)](
          const GroupSpec& spec, backend::RendezvousClient& rendezvous, const std::string& prefix,
          absl::Time deadline) -> absl::StatusOr<std::unique_ptr<backend::Communicator>> {
        backend::GlooCommunicatorOptions g;
        g.group = spec.name;
        g.rank = spec.rank;
        g.world_size = spec.world_size;
        g.host = peer_host;
        g.key_prefix = prefix;
        g.store = &rendezvous;
        g.deadline = deadline;
        QTX_ASSIGN_OR_RETURN(std::unique_ptr<backend::GlooCommunicator> c,
                             backend::GlooCommunicator::Create(g));
        return std::unique_ptr<backend::Communicator>(std::move(c));
      };
}

bool NcclAvailable(const backend::Device& device) {
#ifdef QTX_NCCL_WIRING
  return dynamic_cast<const backend::CudaDevice*>(&device) != nullptr;
#else
  (void)device;
  return false;
#endif
}

CommBackendKind DefaultCommBackend(const backend::Device& device) {
  return NcclAvailable(device) ? CommBackendKind::kNccl : CommBackendKind::kGloo;
}

GroupRegistryOptions WithNcclCommunicator(GroupRegistryOptions options, backend::Device* device) {
  CommunicatorFactory previous = std::move(options.make_communicator);
  options.make_communicator =
      [previous, device](
          const GroupSpec& spec, backend::RendezvousClient& store, const std::string& prefix,
          absl::Time deadline) -> absl::StatusOr<std::unique_ptr<backend::Communicator>> {
    if (spec.backend != CommBackendKind::kNccl) {
      if (!previous) return absl::UnimplementedError("no communicator factory for GLOO");
      return previous(spec, store, prefix, deadline);
    }
#ifdef QTX_NCCL_WIRING
    auto* cuda = dynamic_cast<backend::CudaDevice*>(device);
    if (cuda == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "backend=NCCL: this qtxd computes on %s; NCCL groups need --device=cuda:N",
          device == nullptr ? "no device" : device->name()));
    }
    backend::NcclCommunicatorOptions o;
    o.group = spec.name;
    o.rank = spec.rank;
    o.world_size = spec.world_size;
    o.device_ordinal = cuda->ordinal();
    o.key_prefix = prefix;
    o.store = &store;
    o.deadline = deadline;
    o.default_stream = [cuda]() -> absl::StatusOr<void*> {
      QTX_ASSIGN_OR_RETURN(cudaStream_t s, cuda->CurrentThreadStream());
      return static_cast<void*>(s);
    };
    QTX_ASSIGN_OR_RETURN(std::unique_ptr<backend::NcclCommunicator> c,
                         backend::NcclCommunicator::Create(o));
    return std::unique_ptr<backend::Communicator>(std::move(c));
#else
    (void)device;
    return absl::UnimplementedError(
        "backend=NCCL: this qtxd was built without CUDA/NCCL; use GLOO");
#endif
  };
  return options;
}

}  // namespace qtx::server::collective

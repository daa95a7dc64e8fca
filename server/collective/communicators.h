// The communicator factories of the GroupRegistry: which backend a group
// gets, GlooCommunicator for backend GLOO (host memory over TCP) and
// NcclCommunicator for backend NCCL (on the server's CudaDevice, its
// collectives on the executor thread's device stream). No gRPC.
// Everything here compiles without CUDA/NCCL; it then reports NCCL as not
// available.
#ifndef QTX_SERVER_COLLECTIVE_COMMUNICATORS_H_
#define QTX_SERVER_COLLECTIVE_COMMUNICATORS_H_

#include <string>

#include "server/backend/device.h"
#include "server/collective/group_registry.h"

namespace qtx::server::collective {

// A factory of GlooCommunicators whose connections listen on `peer_host`
// (for every backend: GLOO is the only one it makes).
CommunicatorFactory GlooCommunicatorFactory(std::string peer_host);

// True when this build has the NCCL communicator and `device` is a CUDA device.
bool NcclAvailable(const backend::Device& device);

// The backend of a CreateGroup that names none: NCCL on a CUDA device (when
// available), Gloo otherwise.
CommBackendKind DefaultCommBackend(const backend::Device& device);

// Returns `options` whose make_communicator creates an NcclCommunicator for
// groups with backend NCCL (UNIMPLEMENTED naming the reason when this build
// or this device cannot) and defers to the previous factory otherwise.
// `device` must outlive the registry.
GroupRegistryOptions WithNcclCommunicator(GroupRegistryOptions options, backend::Device* device);

}  // namespace qtx::server::collective

#endif  // QTX_SERVER_COLLECTIVE_COMMUNICATORS_H_

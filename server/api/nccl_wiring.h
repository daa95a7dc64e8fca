// NCCL wiring of the GroupRegistry: which backend a group gets, and the
// communicator factory for backend NCCL (NcclCommunicator on the server's
// CudaDevice, its collectives on the executor thread's device stream).
// Everything here compiles without CUDA/NCCL; it then reports NCCL as not
// available.
#ifndef QTX_SERVER_API_NCCL_WIRING_H_
#define QTX_SERVER_API_NCCL_WIRING_H_

#include "server/backend/device.h"
#include "server/collective/group_registry.h"

namespace qtx::server::api {

// True when this build has the NCCL communicator and `device` is a CUDA device.
bool NcclAvailable(const backend::Device& device);

// The backend of a CreateGroup that names none: NCCL on a CUDA device (when
// available), Gloo otherwise.
collective::CommBackendKind DefaultCommBackend(const backend::Device& device);

// Returns `options` whose make_communicator creates an NcclCommunicator for
// groups with backend NCCL (UNIMPLEMENTED naming the reason when this build
// or this device cannot) and defers to the previous factory otherwise.
// `device` must outlive the registry.
collective::GroupRegistryOptions WithNcclCommunicator(collective::GroupRegistryOptions options,
                                                      backend::Device* device);

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_NCCL_WIRING_H_

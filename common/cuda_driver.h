// The CUDA driver functions qtx calls, found through the runtime
// (cudaGetDriverEntryPointByVersion, CUDA 12 ABI) so that neither qtxd nor the
// client library links against libcuda: a CUDA build still starts on a host
// without a GPU driver. A private header of both the server and the client
// library (header only, CUDA builds only; the client does not install it).
//
//   struct Ops { CUresult (*map)(...) = nullptr; };
//   const std::pair<const char*, void**> wanted[] = {
//       {"cuMemMap", reinterpret_cast<void**>(&ops.map)}};
//   QTX_RETURN_IF_ERROR(qtx::cuda_driver::LoadSymbols(wanted, "cuda_vmm regions"));
//
// Thread-safe.
#ifndef QTX_COMMON_CUDA_DRIVER_H_
#define QTX_COMMON_CUDA_DRIVER_H_

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <span>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"

namespace qtx::cuda_driver {

// Sets each slot of `wanted` to the driver function of that name (the CUDA 12
// ABI). INTERNAL for a runtime error (which it clears); FAILED_PRECONDITION
// naming the first function the driver lacks and `users`, what needs it ("the
// CUDA driver has no X (<users> need a CUDA 12+ driver)").
inline absl::Status LoadSymbols(std::span<const std::pair<const char*, void**>> wanted,
                                std::string_view users) {
  for (const auto& [symbol, slot] : wanted) {
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion(symbol, slot, 12000, cudaEnableDefault, &query);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the non-sticky error
      return absl::InternalError(absl::StrFormat("cudaGetDriverEntryPointByVersion(%s): %s (%s)",
                                                 symbol, cudaGetErrorName(err),
                                                 cudaGetErrorString(err)));
    }
    if (query != cudaDriverEntryPointSuccess || *slot == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrFormat("the CUDA driver has no %s (%s need a CUDA 12+ driver)", symbol, users));
    }
  }
  return absl::OkStatus();
}

// OK for CUDA_SUCCESS, otherwise INTERNAL "<what> failed: CUresult <r>".
inline absl::Status DriverStatus(CUresult r, std::string_view what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s failed: CUresult %d", what, static_cast<int>(r)));
}

// The stream memory operations of the stream-ordered channel, which its two
// ends (the client's stream and qtxd's) both enqueue.
struct StreamMemOps {
  CUresult (*wait)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*write)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
};

// Looked up once per process; every later call returns the same result.
inline absl::StatusOr<StreamMemOps> GetStreamMemOps() {
  static const auto* const ops =
      new absl::StatusOr<StreamMemOps>([]() -> absl::StatusOr<StreamMemOps> {
        StreamMemOps o;
        const std::pair<const char*, void**> wanted[] = {
            {"cuStreamWaitValue64", reinterpret_cast<void**>(&o.wait)},
            {"cuStreamWriteValue64", reinterpret_cast<void**>(&o.write)},
            {"cuDeviceGetAttribute", reinterpret_cast<void**>(&o.get_attribute)}};
        if (absl::Status s = LoadSymbols(wanted, "stream-ordered channels"); !s.ok()) return s;
        return o;
      }());
  return *ops;
}

// The driver's memory functions: address and pointer lookups, and the virtual
// memory management (VMM) calls that export, import and map allocations. The
// client's exports (client/cuda/cuda_ipc.cc) and qtxd's imports
// (server/backend/cuda_device.cc) both use them.
struct MemoryOps {
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*pointer_attribute)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  CUresult (*pointer_attributes)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr) = nullptr;
  CUresult (*retain)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*properties)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long) = nullptr;
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*,
                            CUmemAllocationHandleType) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*free_range)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
};

// Looked up once per process; every later call returns the same result.
inline absl::StatusOr<MemoryOps> GetMemoryOps() {
  static const auto* const ops = new absl::StatusOr<MemoryOps>([]() -> absl::StatusOr<MemoryOps> {
    MemoryOps o;
    const std::pair<const char*, void**> wanted[] = {
        {"cuMemGetAddressRange", reinterpret_cast<void**>(&o.address_range)},
        {"cuPointerGetAttribute", reinterpret_cast<void**>(&o.pointer_attribute)},
        {"cuPointerGetAttributes", reinterpret_cast<void**>(&o.pointer_attributes)},
        {"cuMemRetainAllocationHandle", reinterpret_cast<void**>(&o.retain)},
        {"cuMemRelease", reinterpret_cast<void**>(&o.release)},
        {"cuMemGetAllocationPropertiesFromHandle", reinterpret_cast<void**>(&o.properties)},
        {"cuMemExportToShareableHandle", reinterpret_cast<void**>(&o.export_handle)},
        {"cuMemImportFromShareableHandle", reinterpret_cast<void**>(&o.import_handle)},
        {"cuMemGetAllocationGranularity", reinterpret_cast<void**>(&o.granularity)},
        {"cuMemAddressReserve", reinterpret_cast<void**>(&o.reserve)},
        {"cuMemAddressFree", reinterpret_cast<void**>(&o.free_range)},
        {"cuMemMap", reinterpret_cast<void**>(&o.map)},
        {"cuMemUnmap", reinterpret_cast<void**>(&o.unmap)},
        {"cuMemSetAccess", reinterpret_cast<void**>(&o.set_access)},
        {"cuGetErrorName", reinterpret_cast<void**>(&o.error_name)}};
    if (absl::Status s = LoadSymbols(wanted, "CUDA IPC and VMM memory"); !s.ok()) return s;
    return o;
  }());
  return *ops;
}

}  // namespace qtx::cuda_driver

#endif  // QTX_COMMON_CUDA_DRIVER_H_

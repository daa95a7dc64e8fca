#include "server/api/services.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/api/convert.h"
#include "server/api/request_context.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {

grpc::ServerUnaryReactor* QuantizerService::Quantize(grpc::CallbackServerContext* context,
                                                     const v1::QuantizeRequest* request,
                                                     v1::QuantizeResponse* response) {
  // Parsed here (no tensor bytes are copied) to tell a short call from a long one.
  absl::StatusOr<ops::QuantizeRequestSpec> spec = QuantizeRequestFromProto(*request);
  const bool is_short = !spec.ok() || ops::QuantizeRunsShort(*spec, ctx_);
  return RunShortInline(context, "Quantize", executor_, inline_slots_, is_short,
                        [this, spec = std::move(spec), response]() -> absl::Status {
                          QTX_RETURN_IF_ERROR(spec.status());
                          QTX_ASSIGN_OR_RETURN(ops::QuantizeResult result,
                                               ops::Quantize(*spec, ctx_));
                          QuantizeResultToProto(std::move(result), response);
                          return absl::OkStatus();
                        });
}

grpc::ServerUnaryReactor* QuantizerService::Dequantize(grpc::CallbackServerContext* context,
                                                       const v1::DequantizeRequest* request,
                                                       v1::DequantizeResponse* response) {
  absl::StatusOr<ops::DequantizeRequestSpec> spec = DequantizeRequestFromProto(*request);
  const bool is_short = !spec.ok() || ops::DequantizeRunsShort(*spec, ctx_);
  return RunShortInline(context, "Dequantize", executor_, inline_slots_, is_short,
                        [this, spec = std::move(spec), response]() -> absl::Status {
                          QTX_RETURN_IF_ERROR(spec.status());
                          QTX_ASSIGN_OR_RETURN(ops::OutputTensor out, ops::Dequantize(*spec, ctx_));
                          OutputTensorToProto(std::move(out), response->mutable_output());
                          return absl::OkStatus();
                        });
}

grpc::ServerUnaryReactor* MemoryService::RegisterRegion(grpc::CallbackServerContext* context,
                                                        const v1::RegisterRegionRequest* request,
                                                        v1::RegisterRegionResponse* /*response*/) {
  return RunOnExecutor(context, "RegisterRegion", executor_, [this, request]() -> absl::Status {
    switch (request->kind_case()) {
      case v1::RegisterRegionRequest::kShm: {
        const v1::ShmRegion& shm = request->shm();
        QTX_RETURN_IF_ERROR(
            regions_->RegisterShm(request->name(), shm.shm_name(), shm.offset(), shm.byte_size()));
        spdlog::info("event=region_registered region={} kind=shm shm_name={} offset={} bytes={}",
                     request->name(), shm.shm_name(), shm.offset(), shm.byte_size());
        return absl::OkStatus();
      }
      case v1::RegisterRegionRequest::kCudaIpc: {
        const v1::CudaIpcRegion& ipc = request->cuda_ipc();
        QTX_RETURN_IF_ERROR(regions_->RegisterCudaIpc(request->name(), ipc.ipc_handle(),
                                                      ipc.device_id(), ipc.byte_size(),
                                                      ipc.device_uuid()));
        spdlog::info("event=region_registered region={} kind=cuda_ipc device={} bytes={}",
                     request->name(), ipc.device_id(), ipc.byte_size());
        return absl::OkStatus();
      }
      case v1::RegisterRegionRequest::kCudaVmm: {
        const v1::CudaVmmRegion& vmm = request->cuda_vmm();
        if (fd_inbox_ == nullptr) {
          return absl::FailedPreconditionError(
              "cuda_vmm regions need qtxd's fd socket (<socket>.fd, next to its unix socket), "
              "which this qtxd does not have: start it with --socket, and see its log "
              "(event=fd_socket_unavailable) for why the fd socket could not be made");
        }
        const std::vector<std::string> tokens(vmm.fd_tokens().begin(), vmm.fd_tokens().end());
        QTX_ASSIGN_OR_RETURN(ClaimedFds claimed, fd_inbox_->Claim(tokens));
        std::vector<int> fds;
        fds.reserve(claimed.fds.size());
        for (const OwnedFd& fd : claimed.fds) fds.push_back(fd.get());
        std::vector<uint64_t> sizes;
        sizes.reserve(vmm.chunks_size());
        for (const v1::CudaVmmChunk& c : vmm.chunks()) sizes.push_back(c.size());
        QTX_RETURN_IF_ERROR(regions_->RegisterCudaVmm(request->name(), fds, sizes, vmm.offset(),
                                                      vmm.byte_size(), vmm.device_uuid(),
                                                      claimed.session));
        // The descriptors close when `claimed` goes; the imported memory stays.
        if (!fd_inbox_->IsSessionOpen(claimed.session)) {
          // The client went away while registering: its session's regions
          // were dropped before this one existed.
          (void)regions_->Unregister(request->name());
          return absl::UnavailableError(absl::StrFormat(
              "region '%s': the fd-socket connection that sent its descriptors closed while it "
              "was registered; the region was dropped with that session",
              request->name()));
        }
        spdlog::info(
            "event=region_registered region={} kind=cuda_vmm chunks={} bytes={} session={}",
            request->name(), sizes.size(), vmm.byte_size(), claimed.session);
        return absl::OkStatus();
      }
      case v1::RegisterRegionRequest::KIND_NOT_SET:
        break;
    }
    return absl::InvalidArgumentError("kind: set shm, cuda_ipc or cuda_vmm");
  });
}

grpc::ServerUnaryReactor* MemoryService::UnregisterRegion(
    grpc::CallbackServerContext* context, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse* /*response*/) {
  return RunOnExecutor(context, "UnregisterRegion", executor_, [this, request]() -> absl::Status {
    QTX_RETURN_IF_ERROR(regions_->Unregister(request->name()));
    spdlog::info("event=region_unregistered region={}", request->name());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* MemoryService::ListRegions(grpc::CallbackServerContext* context,
                                                     const v1::ListRegionsRequest* /*request*/,
                                                     v1::ListRegionsResponse* response) {
  // A copy of the table under its lock: short.
  return RunShortInline(context, "ListRegions", executor_, inline_slots_, /*is_short=*/true,
                        [this, response] {
                          for (const tensor::RegionInfo& info : regions_->List()) {
                            RegionInfoToProto(info, response->add_regions());
                          }
                          return absl::OkStatus();
                        });
}

}  // namespace qtx::server::api

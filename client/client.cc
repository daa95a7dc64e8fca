#include "qtx/client.h"

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>

#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client_impl.h"
#include "client/proto_convert.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "qtx/shm_region.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"

namespace qtx {

using client_internal::FromGrpcStatus;
using client_internal::FromProto;
using client_internal::SetCudaEvents;
using client_internal::ToProto;

namespace {

constexpr char kHealthCheckMethod[] = "/grpc.health.v1.Health/Check";

// Normalizes the accepted target spellings to a gRPC target string.
absl::StatusOr<std::string> NormalizeTarget(std::string_view target) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty");
  if (target.front() == '/') return absl::StrCat("unix://", std::string(target));
  return std::string(target);
}

// grpc.health.v1.HealthCheckRequest { string service = 1; }, encoded by hand
// so that the client needs no generated health stubs.
std::string EncodeHealthCheckRequest(std::string_view service) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  if (!service.empty()) {
    coded.WriteTag(google::protobuf::internal::WireFormatLite::MakeTag(
        1, google::protobuf::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    coded.WriteVarint32(static_cast<uint32_t>(service.size()));
    coded.WriteRaw(service.data(), static_cast<int>(service.size()));
  }
  coded.Trim();
  return out;
}

// grpc.health.v1.HealthCheckResponse { ServingStatus status = 1; }.
absl::StatusOr<ServingStatus> DecodeHealthCheckResponse(const std::string& bytes) {
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  uint64_t status = 0;
  while (uint32_t tag = in.ReadTag()) {
    if (tag == WireFormatLite::MakeTag(1, WireFormatLite::WIRETYPE_VARINT)) {
      if (!in.ReadVarint64(&status)) break;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return absl::InternalError("health: malformed HealthCheckResponse");
    }
  }
  if (!in.ConsumedEntireMessage()) {
    return absl::InternalError("health: malformed HealthCheckResponse");
  }
  switch (status) {
    case 1:
      return ServingStatus::kServing;
    case 2:
      return ServingStatus::kNotServing;
    case 3:
      return ServingStatus::kServiceUnknown;
    default:
      return ServingStatus::kUnknown;
  }
}

}  // namespace

const char* ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(std::string_view target,
                                                        const ClientOptions& options) {
  absl::StatusOr<std::string> normalized = NormalizeTarget(target);
  if (!normalized.ok()) return normalized.status();
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes=", options.max_message_bytes, ": must be > 0"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout=", absl::FormatDuration(options.timeout), ": must be > 0"));
  }
  if (options.auth_token.find_first_of("\r\n") != std::string::npos) {
    return absl::InvalidArgumentError("auth_token: must not contain line breaks");
  }
  if (options.tls_client_cert_pem.empty() != options.tls_client_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "tls_client_cert_pem and tls_client_key_pem: give both (mTLS) or neither");
  }
  if (!options.tls && (!options.tls_root_certs_pem.empty() ||
                       !options.tls_client_cert_pem.empty() || !options.tls_server_name.empty())) {
    return absl::InvalidArgumentError("TLS settings given but tls=false: set tls=true");
  }
  if (options.tls && absl::StartsWith(*normalized, "unix:")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls=true with unix socket target '", *normalized,
        "': TLS is for host:port targets (a unix socket is protected by its file mode)"));
  }
  auto impl = std::make_unique<Impl>();
  impl->target = *std::move(normalized);
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(options.max_message_bytes);
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  // A sidecar is usually local: retry a lost connection quickly (gRPC's
  // default starts at 1 s and grows to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs_pem;
    ssl.pem_cert_chain = options.tls_client_cert_pem;
    ssl.pem_private_key = options.tls_client_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  impl->channel = grpc::CreateCustomChannel(impl->target, credentials, args);
  impl->quantizer = v1::Quantizer::NewStub(impl->channel);
  impl->memory = v1::Memory::NewStub(impl->channel);
  impl->stream_channel = v1::StreamChannel::NewStub(impl->channel);
  impl->collective = v1::Collective::NewStub(impl->channel);
  impl->optimizer = v1::Optimizer::NewStub(impl->channel);
  impl->generic = std::make_unique<grpc::GenericStub>(impl->channel);
  std::random_device rd;
  impl->id_prefix = absl::StrFormat("%08x", rd());
  if (options.connect_timeout > absl::ZeroDuration()) {
    const auto deadline = absl::ToChronoTime(absl::Now() + options.connect_timeout);
    if (!impl->channel->WaitForConnected(deadline)) {
      return absl::UnavailableError(absl::StrCat("could not connect to '", impl->target,
                                                 "' within ",
                                                 absl::FormatDuration(options.connect_timeout)));
    }
  }
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

const std::string& Client::target() const { return impl_->target; }

absl::StatusOr<ServingStatus> Client::Health(std::string_view service, const CallOptions& call) {
  return HealthImpl(service, call, impl_->options.wait_for_ready);
}

absl::StatusOr<ServingStatus> Client::HealthImpl(std::string_view service, const CallOptions& call,
                                                 bool wait_for_ready) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, call);
  ctx.set_wait_for_ready(wait_for_ready);
  const std::string request_bytes = EncodeHealthCheckRequest(service);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  impl_->generic->UnaryCall(&ctx, kHealthCheckMethod, grpc::StubOptions(), &request, &response,
                            [&](grpc::Status s) {
                              status = std::move(s);
                              done.Notify();
                            });
  done.WaitForNotification();
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) return ServingStatus::kServiceUnknown;
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) {
    return absl::InternalError("health: could not read the response");
  }
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return DecodeHealthCheckResponse(bytes);
}

absl::Status Client::WaitUntilServing(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::UnavailableError("no health check made");
  absl::Duration backoff = absl::Milliseconds(10);
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    CallOptions call;
    call.timeout = std::min(left, absl::Seconds(2));
    absl::StatusOr<ServingStatus> s = HealthImpl("", call, /*wait_for_ready=*/true);
    if (s.ok() && *s == ServingStatus::kServing) return absl::OkStatus();
    last = s.ok() ? absl::UnavailableError(absl::StrCat("status ", ServingStatusName(*s)))
                  : s.status();
    absl::SleepFor(std::min(backoff, deadline - absl::Now()));
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
  }
  return absl::DeadlineExceededError(absl::StrCat("'", impl_->target, "' not SERVING after ",
                                                  absl::FormatDuration(timeout),
                                                  "; last health check: ", last.ToString()));
}

absl::StatusOr<QuantizedTensor> Client::Quantize(const Tensor& input, const QuantizeConfig& config,
                                                 const QuantizeOutputs& outputs,
                                                 const CallOptions& call) {
  v1::QuantizeRequest request;
  ToProto(input, request.mutable_input());
  ToProto(config, request.mutable_config());
  ToProto(outputs, request.mutable_outputs());
  SetCudaEvents(call, &request);
  v1::QuantizeResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->quantizer, &v1::Quantizer::Stub::Quantize, request, &response, call));
  return FromProto(std::move(*response.mutable_result()));
}

absl::StatusOr<Tensor> Client::Dequantize(const QuantizedTensor& input, DType output_dtype,
                                          const std::optional<RegionSlice>& output,
                                          const CallOptions& call) {
  v1::DequantizeRequest request;
  ToProto(input, request.mutable_input());
  request.set_output_dtype(static_cast<v1::DType>(output_dtype));
  if (output) ToProto(*output, request.mutable_output());
  SetCudaEvents(call, &request);
  v1::DequantizeResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->quantizer, &v1::Quantizer::Stub::Dequantize, request, &response, call));
  return FromProto(std::move(*response.mutable_output()));
}

absl::Status Client::RegisterShmRegion(std::string_view name, std::string_view shm_name,
                                       uint64_t offset, uint64_t byte_size,
                                       const CallOptions& call) {
  v1::RegisterRegionRequest request;
  request.set_name(std::string(name));
  v1::ShmRegion* shm = request.mutable_shm();
  shm->set_shm_name(std::string(shm_name));
  shm->set_offset(offset);
  shm->set_byte_size(byte_size);
  v1::RegisterRegionResponse response;
  return impl_->Call(*impl_->memory, &v1::Memory::Stub::RegisterRegion, request, &response, call);
}

absl::Status Client::RegisterCudaIpcRegion(std::string_view name, std::string_view ipc_handle,
                                           int32_t device_id, uint64_t byte_size,
                                           const CallOptions& call) {
  v1::RegisterRegionRequest request;
  request.set_name(std::string(name));
  v1::CudaIpcRegion* ipc = request.mutable_cuda_ipc();
  ipc->set_ipc_handle(std::string(ipc_handle));
  ipc->set_device_id(device_id);
  ipc->set_byte_size(byte_size);
  v1::RegisterRegionResponse response;
  return impl_->Call(*impl_->memory, &v1::Memory::Stub::RegisterRegion, request, &response, call);
}

absl::Status Client::RegisterCudaIpcRegionOnGpu(std::string_view name, std::string_view ipc_handle,
                                                std::string_view device_uuid, uint64_t byte_size,
                                                const CallOptions& call) {
  v1::RegisterRegionRequest request;
  request.set_name(std::string(name));
  v1::CudaIpcRegion* ipc = request.mutable_cuda_ipc();
  ipc->set_ipc_handle(std::string(ipc_handle));
  ipc->set_device_uuid(std::string(device_uuid));
  ipc->set_byte_size(byte_size);
  v1::RegisterRegionResponse response;
  return impl_->Call(*impl_->memory, &v1::Memory::Stub::RegisterRegion, request, &response, call);
}

absl::Status Client::RegisterCudaVmmRegion(std::string_view name,
                                           const std::vector<std::string>& fd_tokens,
                                           const std::vector<uint64_t>& chunk_sizes,
                                           uint64_t offset, uint64_t byte_size,
                                           std::string_view device_uuid, const CallOptions& call) {
  v1::RegisterRegionRequest request;
  request.set_name(std::string(name));
  v1::CudaVmmRegion* vmm = request.mutable_cuda_vmm();
  for (const std::string& t : fd_tokens) vmm->add_fd_tokens(t);
  for (uint64_t size : chunk_sizes) vmm->add_chunks()->set_size(size);
  vmm->set_offset(offset);
  vmm->set_byte_size(byte_size);
  vmm->set_device_uuid(std::string(device_uuid));
  v1::RegisterRegionResponse response;
  return impl_->Call(*impl_->memory, &v1::Memory::Stub::RegisterRegion, request, &response, call);
}

absl::Status Client::RegisterShmRegion(const ShmRegion& region, const CallOptions& call) {
  return RegisterShmRegion(region.name(), region.shm_name(), 0, region.size(), call);
}

absl::Status Client::UnregisterRegion(std::string_view name, const CallOptions& call) {
  v1::UnregisterRegionRequest request;
  request.set_name(std::string(name));
  v1::UnregisterRegionResponse response;
  return impl_->Call(*impl_->memory, &v1::Memory::Stub::UnregisterRegion, request, &response, call);
}

absl::StatusOr<std::vector<RegionInfo>> Client::ListRegions(const CallOptions& call) {
  v1::ListRegionsRequest request;
  v1::ListRegionsResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->memory, &v1::Memory::Stub::ListRegions, request, &response, call));
  std::vector<RegionInfo> out;
  out.reserve(response.regions_size());
  for (const v1::RegionInfo& r : response.regions()) out.push_back(FromProto(r));
  return out;
}

}  // namespace qtx

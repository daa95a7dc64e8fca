#include "server/api/collective_service.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "server/api/convert.h"
#include "server/api/request_context.h"
#include "server/collective/communicators.h"
#include "server/ops/allgather.h"
#include "server/ops/param_allgather.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {
namespace {

constexpr absl::Duration kDefaultGroupTimeout = absl::Milliseconds(60000);
constexpr absl::Duration kMaxRendezvousWait = absl::Minutes(10);

absl::Status FromGrpc(const grpc::Status& s, std::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrFormat("%s: %s", what, s.error_message()));
}

// The deadline the server side works to: shortly before the client's gRPC
// deadline, so that our own, more precise error reaches the client first.
absl::Time WorkDeadline(const grpc::CallbackServerContext& context, absl::Duration cap) {
  const absl::Time now = absl::Now();
  absl::Time d = absl::FromChrono(context.deadline());
  if (d >= now + cap || d == absl::InfiniteFuture()) return now + cap;
  const absl::Duration left = d - now;
  return d - std::min(absl::Milliseconds(500), left / 10);
}

void GroupInfoToProto(const collective::GroupInfo& i, v1::GroupInfo* out) {
  out->set_name(i.name);
  out->set_rank(i.rank);
  out->set_world_size(i.world_size);
  out->set_backend(i.backend == collective::CommBackendKind::kNccl ? v1::NCCL : v1::GLOO);
  switch (i.state) {
    case collective::GroupState::kReady:
      out->set_state(v1::READY);
      break;
    case collective::GroupState::kBroken:
      out->set_state(v1::BROKEN);
      break;
    case collective::GroupState::kJoining:
      out->set_state(v1::GROUP_STATE_UNSPECIFIED);
      break;
  }
  out->set_next_sequence(i.next_sequence);
  out->set_error(i.error);
}

absl::StatusOr<collective::GroupSpec> GroupSpecFromProto(const v1::CreateGroupRequest& r) {
  collective::GroupSpec s;
  s.name = r.name();
  s.rank = r.rank();
  s.world_size = r.world_size();
  s.coordinator = r.coordinator();
  s.timeout = r.timeout_ms() == 0 ? kDefaultGroupTimeout : absl::Milliseconds(r.timeout_ms());
  switch (r.backend()) {
    case v1::COMM_BACKEND_UNSPECIFIED:
    case v1::GLOO:
      s.backend = collective::CommBackendKind::kGloo;
      break;
    case v1::NCCL:
      s.backend = collective::CommBackendKind::kNccl;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("backend=%d: must be GLOO or NCCL", static_cast<int>(r.backend())));
  }
  return s;
}

// Rendezvous.Get: parked in the KvStore, finished by its callback.
class GetReactor final : public grpc::ServerUnaryReactor {
 public:
  GetReactor(grpc::CallbackServerContext* context, collective::KvStore* store,
             const v1::RendezvousGetRequest* request, v1::RendezvousGetResponse* response)
      : store_(store), response_(response), log_(StartRequest(context, "Rendezvous.Get")) {
    std::vector<std::string> keys(request->keys().begin(), request->keys().end());
    absl::Time deadline = WorkDeadline(*context, kMaxRendezvousWait);
    if (request->max_wait_ms() > 0) {
      deadline = std::min(deadline, absl::Now() + absl::Milliseconds(request->max_wait_ms()));
    }
    const collective::KvStore::WaiterId id = store_->GetAsync(
        std::move(keys), deadline,
        [this](absl::StatusOr<std::vector<std::string>> values) { Done(std::move(values)); });
    absl::MutexLock lock(&mu_);
    if (!finished_) id_ = id;
  }

  void OnCancel() override {
    collective::KvStore::WaiterId id = 0;
    {
      absl::MutexLock lock(&mu_);
      id = id_;
    }
    if (id != 0) store_->Cancel(id);  // runs Done (CANCELLED) unless already done
  }
  void OnDone() override { delete this; }

 private:
  void Done(absl::StatusOr<std::vector<std::string>> values) {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
      id_ = 0;
    }
    if (values.ok()) {
      for (auto& v : *values) response_->add_values(std::move(v));
    }
    Finish(EndRequest(log_, values.status()));
  }

  collective::KvStore* const store_;
  v1::RendezvousGetResponse* const response_;
  const RequestLog log_;
  absl::Mutex mu_;
  collective::KvStore::WaiterId id_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// CreateGroup: joins on the group's executor, which finishes the call. The
// join ends at the call's deadline too, and when the client cancels (or the
// server, shutting down, cancels the call).
class CreateGroupReactor final : public grpc::ServerUnaryReactor {
 public:
  CreateGroupReactor(grpc::CallbackServerContext* context, collective::GroupRegistry* registry,
                     const ops::OpContext& ctx, const v1::CreateGroupRequest* request,
                     v1::CreateGroupResponse* response)
      : log_(StartRequest(context, "CreateGroup")) {
    absl::StatusOr<collective::GroupSpec> spec = GroupSpecFromProto(*request);
    if (spec.ok() && request->backend() == v1::COMM_BACKEND_UNSPECIFIED) {
      spec->backend = collective::DefaultCommBackend(*ctx.device);  // NCCL on a CUDA device
    }
    if (!spec.ok()) {
      Finish(EndRequest(log_, spec.status()));
      return;
    }
    collective::JoinControl control;
    control.deadline = WorkDeadline(*context, spec->timeout);
    control.cancelled = cancelled_;
    registry->CreateGroup(
        std::move(*spec),
        [this, response](absl::StatusOr<collective::GroupInfo> info) {
          if (info.ok()) GroupInfoToProto(*info, response->mutable_group());
          Finish(EndRequest(log_, info.status()));
        },
        std::move(control));
  }

  void OnCancel() override { cancelled_->store(true); }
  void OnDone() override { delete this; }

 private:
  const RequestLog log_;
  const std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace

ops::AllGatherRequestSpec AllGatherFromProto(const v1::AllGatherRequest& r) {
  ops::AllGatherRequestSpec spec;
  spec.group = r.group();
  spec.sequence = r.sequence();
  // First: the payload layout of the one-round path depends on it even when
  // the rest of the request is rejected.
  spec.shard_rows.assign(r.shard_rows().begin(), r.shard_rows().end());
  spec.request_error = [&]() -> absl::Status {
    if (!r.has_input()) return absl::InvalidArgumentError("input: missing");
    QTX_ASSIGN_OR_RETURN(spec.input, TensorRefFromProto(r.input(), "input"));
    QTX_ASSIGN_OR_RETURN(spec.params, ParamsFromProto(r.config(), "config"));
    switch (r.mode()) {
      case v1::ALL_GATHER_MODE_UNSPECIFIED:
      case v1::EXACT_FP8:
        spec.mode = ops::AllGatherMode::kExactFp8;
        break;
      case v1::GATHER_HIGH_PRECISION:
        spec.mode = ops::AllGatherMode::kGatherHighPrecision;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat(
            "mode=%d: must be EXACT_FP8 or GATHER_HIGH_PRECISION", static_cast<int>(r.mode())));
    }
    QuantizeOutputsFromProto(r.outputs(), &spec.outputs);
    spec.events = CudaEventsFromProto(r.cuda_events());
    return absl::OkStatus();
  }();
  return spec;
}

ops::ParamAllGatherRequestSpec AllGatherParameterFromProto(const v1::AllGatherParameterRequest& r) {
  ops::ParamAllGatherRequestSpec spec;
  spec.group = r.group();
  spec.sequence = r.sequence();
  spec.name = r.name();
  spec.range = {r.range().begin(), r.range().end()};
  spec.request_error = [&]() -> absl::Status {
    if (!r.has_shard()) return absl::InvalidArgumentError("shard: missing");
    const v1::QuantizedTensor& q = r.shard();
    spec.shape.assign(q.shape().begin(), q.shape().end());
    QTX_ASSIGN_OR_RETURN(spec.params, ParamsFromProto(q.config(), "shard.config"));
    if (q.has_rowwise_data()) {
      QTX_ASSIGN_OR_RETURN(spec.data, TensorRefFromProto(q.rowwise_data(), "shard.rowwise_data"));
    }
    if (q.has_rowwise_scale_inv()) {
      QTX_ASSIGN_OR_RETURN(spec.scale_inv,
                           TensorRefFromProto(q.rowwise_scale_inv(), "shard.rowwise_scale_inv"));
    }
    spec.has_columnwise_data = q.has_columnwise_data();
    QuantizeOutputsFromProto(r.outputs(), &spec.outputs);
    spec.events = CudaEventsFromProto(r.cuda_events());
    return absl::OkStatus();
  }();
  return spec;
}

grpc::ServerUnaryReactor* CollectiveService::CreateGroup(grpc::CallbackServerContext* context,
                                                         const v1::CreateGroupRequest* request,
                                                         v1::CreateGroupResponse* response) {
  return new CreateGroupReactor(context, registry_, ctx_, request, response);
}

absl::Duration CollectiveService::GroupTimeout(const std::string& group) const {
  if (auto info = registry_->GetGroup(group); info.ok()) return info->timeout;
  return kDefaultGroupTimeout;
}

void CollectiveService::SubmitAllGather(
    std::shared_ptr<ops::AllGatherRequestSpec> spec, absl::Time deadline,
    std::function<void(absl::Status, ops::AllGatherResult*)> done) {
  const std::string group = spec->group;
  collective::Collective c;
  c.sequence = spec->sequence;
  c.deadline = deadline;
  auto result = std::make_shared<absl::StatusOr<ops::AllGatherResult>>(
      absl::UnknownError("AllGather did not run"));
  c.run = [this, spec, result, deadline](backend::Communicator& comm) {
    bool broken = false;
    *result = ops::AllGather(*spec, ctx_, comm, backend::CommCall{deadline}, &broken);
    absl::Status s = result->status();
    if (result->ok() && spdlog::should_log(spdlog::level::debug)) {
      // Host time of each step on the group's thread (a stream-ordered call
      // only enqueues its GPU work: every step is short).
      const ops::AllGatherTiming& t = (*result)->timing;
      spdlog::debug(
          "event=allgather_steps group={} seq={} channel={} local_us={:.1f} header_us={:.1f} "
          "prepare_us={:.1f} gather_us={:.1f} assemble_us={:.1f}",
          spec->group, spec->sequence, spec->events.queue != nullptr,
          absl::ToDoubleMicroseconds(t.local), absl::ToDoubleMicroseconds(t.header),
          absl::ToDoubleMicroseconds(t.prepare), absl::ToDoubleMicroseconds(t.gather),
          absl::ToDoubleMicroseconds(t.assemble));
    }
    if (broken && s.code() != absl::StatusCode::kDeadlineExceeded) {
      // A peer died or the transport failed: the whole call is aborted.
      s = absl::AbortedError(absl::StrFormat("%s (the group is now BROKEN)", s.message()));
    }
    return collective::CollectiveOutcome{s, broken};
  };
  c.finish = [result, done = std::move(done)](absl::Status s) {
    done(s, s.ok() && result->ok() ? &**result : nullptr);
  };
  registry_->Submit(group, std::move(c));
}

grpc::ServerUnaryReactor* CollectiveService::AllGather(grpc::CallbackServerContext* context,
                                                       const v1::AllGatherRequest* request,
                                                       v1::AllGatherResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RequestLog log = StartRequest(context, "AllGather");
  auto spec = std::make_shared<ops::AllGatherRequestSpec>(AllGatherFromProto(*request));
  SubmitAllGather(spec, WorkDeadline(*context, GroupTimeout(request->group())),
                  [reactor, log, response](absl::Status s, ops::AllGatherResult* r) {
                    if (r != nullptr) {
                      QuantizedTensorToProto(std::move(r->result), response->mutable_result());
                      for (int64_t m : r->shard_rows) response->add_shard_rows(m);
                    }
                    reactor->Finish(EndRequest(log, s));
                  });
  return reactor;
}

grpc::ServerUnaryReactor* CollectiveService::AllGatherParameter(
    grpc::CallbackServerContext* context, const v1::AllGatherParameterRequest* request,
    v1::AllGatherParameterResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RequestLog log = StartRequest(context, "AllGatherParameter");
  // The spec borrows inline bytes from the request, which outlives the call.
  auto spec =
      std::make_shared<ops::ParamAllGatherRequestSpec>(AllGatherParameterFromProto(*request));
  const absl::Time deadline = WorkDeadline(*context, GroupTimeout(request->group()));
  collective::Collective c;
  c.sequence = spec->sequence;
  c.deadline = deadline;
  auto result = std::make_shared<absl::StatusOr<ops::ParamAllGatherResult>>(
      absl::UnknownError("AllGatherParameter did not run"));
  c.run = [this, spec, result, deadline](backend::Communicator& comm) {
    bool broken = false;
    *result = ops::AllGatherParameter(*spec, ctx_, comm, backend::CommCall{deadline}, &broken);
    absl::Status s = result->status();
    if (broken && s.code() != absl::StatusCode::kDeadlineExceeded) {
      s = absl::AbortedError(absl::StrFormat("%s (the group is now BROKEN)", s.message()));
    }
    return collective::CollectiveOutcome{s, broken};
  };
  c.finish = [reactor, log, response, result](absl::Status s) {
    if (s.ok() && result->ok()) {
      QuantizedTensorToProto(std::move((*result)->result), response->mutable_result());
      for (const kernels::ElementRange& g : (*result)->ranges) {
        v1::ShardRange* out = response->add_ranges();
        out->set_begin(g.begin);
        out->set_end(g.end);
      }
    }
    reactor->Finish(EndRequest(log, s));
  };
  registry_->Submit(request->group(), std::move(c));
  return reactor;
}

grpc::ServerUnaryReactor* CollectiveService::DestroyGroup(grpc::CallbackServerContext* context,
                                                          const v1::DestroyGroupRequest* request,
                                                          v1::DestroyGroupResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RequestLog log = StartRequest(context, "DestroyGroup");
  reactor->Finish(EndRequest(log, registry_->DestroyGroup(request->name())));
  return reactor;
}

grpc::ServerUnaryReactor* CollectiveService::ListGroups(grpc::CallbackServerContext* context,
                                                        const v1::ListGroupsRequest* /*request*/,
                                                        v1::ListGroupsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RequestLog log = StartRequest(context, "ListGroups");
  for (const auto& g : registry_->ListGroups()) GroupInfoToProto(g, response->add_groups());
  reactor->Finish(EndRequest(log, absl::OkStatus()));
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousService::Set(grpc::CallbackServerContext* context,
                                                 const v1::RendezvousSetRequest* request,
                                                 v1::RendezvousSetResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RequestLog log = StartRequest(context, "Rendezvous.Set");
  reactor->Finish(EndRequest(log, store_->Put(request->key(), request->value())));
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousService::Get(grpc::CallbackServerContext* context,
                                                 const v1::RendezvousGetRequest* request,
                                                 v1::RendezvousGetResponse* response) {
  return new GetReactor(context, store_, request, response);
}

GrpcRendezvousClient::GrpcRendezvousClient(const std::string& target, const PeerSecurity& security)
    : target_(target),
      token_(security.token),
      stub_(v1::Rendezvous::NewStub(
          grpc::CreateChannel(target, PeerChannelCredentials(security, target)))) {}

void GrpcRendezvousClient::Authorize(grpc::ClientContext* ctx) const {
  if (!token_.empty()) ctx->AddMetadata(std::string(kAuthorizationHeader), "Bearer " + token_);
}

absl::Status GrpcRendezvousClient::Set(std::string_view key, std::string_view value,
                                       absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  ctx.set_wait_for_ready(true);
  Authorize(&ctx);
  v1::RendezvousSetRequest req;
  req.set_key(std::string(key));
  req.set_value(std::string(value));
  v1::RendezvousSetResponse resp;
  return FromGrpc(stub_->Set(&ctx, req, &resp),
                  absl::StrFormat("rendezvous store at '%s'", target_));
}

absl::StatusOr<std::vector<std::string>> GrpcRendezvousClient::Get(
    std::span<const std::string> keys, absl::Time deadline) {
  grpc::ClientContext ctx;
  // The server stops waiting a little before this and names the missing keys.
  ctx.set_deadline(absl::ToChronoTime(deadline + absl::Seconds(1)));
  ctx.set_wait_for_ready(true);
  Authorize(&ctx);
  v1::RendezvousGetRequest req;
  for (const auto& k : keys) req.add_keys(k);
  // The server answers at `deadline` (at least 1 ms: a peek) with the store's
  // own message naming the missing keys.
  req.set_max_wait_ms(static_cast<uint32_t>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(deadline - absl::Now()), 1, int64_t{24} * 3600 * 1000)));
  v1::RendezvousGetResponse resp;
  QTX_RETURN_IF_ERROR(
      FromGrpc(stub_->Get(&ctx, req, &resp), absl::StrFormat("rendezvous store at '%s'", target_)));
  if (resp.values_size() != static_cast<int>(keys.size())) {
    return absl::InternalError(absl::StrFormat("rendezvous store at '%s': %d values for %d keys",
                                               target_, resp.values_size(), keys.size()));
  }
  return std::vector<std::string>(resp.values().begin(), resp.values().end());
}

collective::GroupRegistryOptions MakeGroupRegistryOptions(collective::KvStore* store,
                                                          const std::string& peer_host,
                                                          const PeerSecurity& security) {
  collective::GroupRegistryOptions o;
  o.local_store = store;
  o.connect = [security](const std::string& coordinator)
      -> absl::StatusOr<std::unique_ptr<backend::RendezvousClient>> {
    return std::make_unique<GrpcRendezvousClient>(coordinator, security);
  };
  o.make_communicator = collective::GlooCommunicatorFactory(peer_host);
  return o;
}

}  // namespace qtx::server::api

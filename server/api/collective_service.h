// gRPC front of the collectives: qtx.v1.Collective (groups and AllGather),
// qtx.v1.Rendezvous (the key-value store this sidecar hosts for groups whose
// rank 0 it is), and GrpcRendezvousClient (how ranks > 0 reach that store).
//
// Handlers hold no math and never block a reaction: CreateGroup and
// AllGather hand their work to the group's executor (GroupRegistry), which
// finishes the call; Rendezvous.Get parks its reactor in the KvStore until
// the keys arrive, its deadline passes or the client cancels.
//
// Thread safety: the services are safe for concurrent use; the registry,
// store and OpContext members must outlive them.
#ifndef QTX_SERVER_API_COLLECTIVE_SERVICE_H_
#define QTX_SERVER_API_COLLECTIVE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "qtx/v1/collective.grpc.pb.h"
#include "server/api/security.h"
#include "server/backend/communicator.h"
#include "server/collective/group_registry.h"
#include "server/collective/kv_store.h"
#include "server/ops/allgather.h"
#include "server/ops/op_context.h"
#include "server/ops/param_allgather.h"

namespace qtx::server::api {

// The op spec of an AllGather request; a request that cannot be parsed gives
// a spec whose request_error says why (every rank then fails with it).
ops::AllGatherRequestSpec AllGatherFromProto(const v1::AllGatherRequest& r);

// The op spec of an AllGatherParameter request (request_error as above).
ops::ParamAllGatherRequestSpec AllGatherParameterFromProto(const v1::AllGatherParameterRequest& r);

class CollectiveService final : public v1::Collective::CallbackService {
 public:
  CollectiveService(ops::OpContext ctx, collective::GroupRegistry* registry)
      : ctx_(ctx), registry_(registry) {}

  grpc::ServerUnaryReactor* CreateGroup(grpc::CallbackServerContext* context,
                                        const v1::CreateGroupRequest* request,
                                        v1::CreateGroupResponse* response) override;
  grpc::ServerUnaryReactor* AllGather(grpc::CallbackServerContext* context,
                                      const v1::AllGatherRequest* request,
                                      v1::AllGatherResponse* response) override;
  // The FP8 parameter all-gather (ops/param_allgather.h), on the group's
  // executor like AllGather.
  grpc::ServerUnaryReactor* AllGatherParameter(grpc::CallbackServerContext* context,
                                               const v1::AllGatherParameterRequest* request,
                                               v1::AllGatherParameterResponse* response) override;
  grpc::ServerUnaryReactor* DestroyGroup(grpc::CallbackServerContext* context,
                                         const v1::DestroyGroupRequest* request,
                                         v1::DestroyGroupResponse* response) override;
  grpc::ServerUnaryReactor* ListGroups(grpc::CallbackServerContext* context,
                                       const v1::ListGroupsRequest* request,
                                       v1::ListGroupsResponse* response) override;

  // Runs `spec` on its group's thread (in sequence order), working to
  // `deadline`, and calls `done` with the status and, when OK, the result
  // (on that thread). Used by AllGather and by stream-ordered channels.
  void SubmitAllGather(std::shared_ptr<ops::AllGatherRequestSpec> spec, absl::Time deadline,
                       std::function<void(absl::Status, ops::AllGatherResult*)> done);
  // The group's timeout (the default for an unknown group: the call then
  // fails with NOT_FOUND anyway).
  absl::Duration GroupTimeout(const std::string& group) const;

 private:
  // Constant after construction.
  const ops::OpContext ctx_;
  collective::GroupRegistry* const registry_;
};

class RendezvousService final : public v1::Rendezvous::CallbackService {
 public:
  explicit RendezvousService(collective::KvStore* store) : store_(store) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context,
                                const v1::RendezvousSetRequest* request,
                                v1::RendezvousSetResponse* response) override;
  // Waits until every key exists, until shortly before the call's gRPC
  // deadline (so that the client gets the store's DEADLINE_EXCEEDED naming
  // the missing keys), or at most 10 minutes.
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::RendezvousGetRequest* request,
                                v1::RendezvousGetResponse* response) override;

 private:
  collective::KvStore* const store_;
};

// backend::RendezvousClient over qtx.v1.Rendezvous at `target` (a gRPC
// target: "host:port" or "unix:/path"). Calls wait for the channel to
// connect until their deadline. `security` gives the channel credentials
// (TLS to TCP targets when this sidecar has TLS) and the bearer token sent
// with every call. Safe for concurrent use.
class GrpcRendezvousClient final : public backend::RendezvousClient {
 public:
  explicit GrpcRendezvousClient(const std::string& target, const PeerSecurity& security = {});

  absl::Status Set(std::string_view key, std::string_view value, absl::Time deadline) override;
  absl::StatusOr<std::vector<std::string>> Get(std::span<const std::string> keys,
                                               absl::Time deadline) override;

 private:
  void Authorize(grpc::ClientContext* ctx) const;

  const std::string target_;
  const std::string token_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
};

// The production GroupRegistry wiring: Gloo communicators listening on
// `peer_host`, rendezvous over GrpcRendezvousClient (with `security`), this
// sidecar's `store`.
collective::GroupRegistryOptions MakeGroupRegistryOptions(collective::KvStore* store,
                                                          const std::string& peer_host,
                                                          const PeerSecurity& security = {});

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_COLLECTIVE_SERVICE_H_

// GroupRegistry: the collective groups this sidecar takes part in.
//
// A group is a set of `world_size` sidecars, one per rank, that run
// collectives together (at most kMaxWorldSize). Every rank calls CreateGroup
// on its own sidecar with the same name and world size; rank 0's sidecar
// hosts the rendezvous store (a KvStore behind qtx.v1.Rendezvous) through
// which the ranks meet and the communicator bootstraps. Keys of one group live
// in the store namespace "qtx/group/<name>/", opened by rank 0 with a budget
// sized to the world size (GroupRendezvousBudget):
//   qtx/group/<name>/session             (a random id chosen by rank 0; present
//                                         only while rank 0 waits for joiners)
//   qtx/group/<name>/<session>/join/<r>  (rank r has joined)
//   qtx/group/<name>/<session>/formed    ("ok" once every rank joined, or why
//                                         the join failed on rank 0)
//   qtx/group/<name>/<session>/comm/...  (the communicator's own keys)
//
// Joining costs O(1) memory per rank that is present: rank 0 waits for the
// join keys one at a time and then writes "formed"; ranks > 0 wait for
// "formed" only. A rank that re-creates a group whose rank 0 still runs an
// older incarnation finds no session key and waits (until its deadline) for
// rank 0 to create the new one. Join errors name at most a few ranks and a
// count. A join ends early, and the group is removed, when the group is
// destroyed (ABORTED), when the caller cancels it (CANCELLED, JoinControl),
// or at the caller's deadline (DEADLINE_EXCEEDED). The namespace is erased
// when rank 0's group is destroyed, or a few seconds after it failed to form
// (peers may still be reading "formed").
//
// Each group owns one executor thread. Joining and every collective run
// there, never on the caller's (gRPC) thread; calls of one group run one at a
// time in sequence-number order, calls of different groups in parallel.
//
// Sequence numbers: the n-th collective of a group carries sequence n-1 on
// every rank. A call whose sequence was already used fails with
// FAILED_PRECONDITION naming the expected one; a call ahead of the next
// expected one (by at most max_sequence_lookahead) waits for its predecessors
// until its deadline, then fails the same way.
//
// States: JOINING -> READY, and READY -> BROKEN when a collective failed in a
// way that leaves the ranks out of step (peer missing, dead, or a transport
// error). A BROKEN group refuses calls with ABORTED until it is destroyed;
// its name can then be reused.
//
// Thread safety: safe for concurrent use. Callbacks run on the group's
// executor thread, or inline on the calling thread for errors found at once.
#ifndef QTX_SERVER_COLLECTIVE_GROUP_REGISTRY_H_
#define QTX_SERVER_COLLECTIVE_GROUP_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/communicator.h"
#include "server/collective/kv_store.h"

namespace qtx::server::collective {

// The largest world_size CreateGroup accepts. Gloo connects every pair of
// ranks (one socket per peer per sidecar, and ~140 bytes of address per pair
// in the rendezvous store), so this also bounds the memory and descriptors a
// group may take.
inline constexpr int kMaxWorldSize = 1024;

enum class CommBackendKind { kGloo, kNccl };
enum class GroupState { kJoining, kReady, kBroken };

std::string_view GroupStateName(GroupState s);
std::string_view CommBackendName(CommBackendKind b);

struct GroupSpec {
  std::string name;
  int rank = 0;
  int world_size = 1;
  // gRPC target of rank 0's sidecar; ignored (may be empty) on rank 0.
  std::string coordinator;
  CommBackendKind backend = CommBackendKind::kGloo;
  // Join deadline, and the default deadline of the group's collectives.
  absl::Duration timeout = absl::Seconds(60);
};

// How a caller steers one CreateGroup besides its spec.
struct JoinControl {
  // The join gives up here if that is before spec.timeout has passed (the
  // caller's own RPC deadline).
  absl::Time deadline = absl::InfiniteFuture();
  // Set from any thread to abandon the join (the client cancelled): the
  // group is removed and `done` gets CANCELLED. May be null.
  std::shared_ptr<const std::atomic<bool>> cancelled;
};

// The rendezvous budget of a group of `world_size` ranks (keys, and bytes of
// keys + values): what its join keys and the communicator's bootstrap need.
NamespaceLimits GroupRendezvousBudget(int world_size);

struct GroupInfo {
  std::string name;
  int rank = 0;
  int world_size = 0;
  CommBackendKind backend = CommBackendKind::kGloo;
  GroupState state = GroupState::kJoining;
  uint64_t next_sequence = 0;
  std::string error;  // why the group is BROKEN
  absl::Duration timeout;
};

// Bootstraps a group's communicator through `store`, under `key_prefix`.
using CommunicatorFactory = std::function<absl::StatusOr<std::unique_ptr<backend::Communicator>>(
    const GroupSpec& spec, backend::RendezvousClient& store, const std::string& key_prefix,
    absl::Time deadline)>;
// Opens a client to the rendezvous store of the sidecar at `coordinator`.
using RendezvousConnector =
    std::function<absl::StatusOr<std::unique_ptr<backend::RendezvousClient>>(
        const std::string& coordinator)>;

// What a collective body reports back to the registry.
struct CollectiveOutcome {
  absl::Status status;
  // Set when the ranks may be out of step (a transport failure): the group
  // becomes BROKEN and every queued call fails with ABORTED.
  bool group_broken = false;
};

struct Collective {
  uint64_t sequence = 0;
  absl::Time deadline = absl::InfiniteFuture();
  // Runs on the executor when the call's turn comes, with the group's
  // communicator. Not called when the call fails before its turn.
  std::function<CollectiveOutcome(backend::Communicator& comm)> run;
  // Called exactly once with the final status (run's, or why it never ran).
  std::function<void(absl::Status)> finish;
};

struct GroupRegistryOptions {
  KvStore* local_store = nullptr;  // this sidecar's rendezvous store; not owned
  RendezvousConnector connect;
  CommunicatorFactory make_communicator;
  int max_groups = 256;
  uint64_t max_sequence_lookahead = 64;
  absl::Duration max_timeout = absl::Hours(1);
};

class GroupRegistry {
 public:
  explicit GroupRegistry(GroupRegistryOptions options);
  // Aborts every group and joins the executors (a running collective ends at
  // the latest at its deadline).
  ~GroupRegistry();
  GroupRegistry(const GroupRegistry&) = delete;
  GroupRegistry& operator=(const GroupRegistry&) = delete;

  // INVALID_ARGUMENT naming the field: empty or oversized name or one with
  // characters outside [A-Za-z0-9_.-], world_size outside [1, kMaxWorldSize], rank outside
  // [0, world_size), no coordinator on a rank > 0, timeout <= 0 or above
  // max_timeout. UNIMPLEMENTED for a backend this build cannot create.
  absl::Status ValidateSpec(const GroupSpec& spec) const;

  // Registers the group as JOINING and joins on its executor. `done` gets the
  // READY group, or: the ValidateSpec errors; ALREADY_EXISTS when this
  // sidecar has a group of that name; RESOURCE_EXHAUSTED past max_groups;
  // DEADLINE_EXCEEDED naming a few of the ranks that did not join and their
  // count (or rank 0, when the coordinator never created the group) within
  // spec.timeout or by control.deadline; ABORTED when the group is destroyed
  // (or the registry shut down) while joining; CANCELLED when
  // control.cancelled is set; UNAVAILABLE when the coordinator cannot be
  // reached; the communicator's errors. A group that failed to join is
  // removed; its name can be reused at once.
  void CreateGroup(GroupSpec spec, std::function<void(absl::StatusOr<GroupInfo>)> done,
                   JoinControl control = {});

  // Queues a collective on `group`. `c.finish` gets: NOT_FOUND for an unknown
  // group; FAILED_PRECONDITION while JOINING, or for a sequence that is not
  // the group's next (naming the expected one); ABORTED when the group is
  // BROKEN or destroyed; otherwise run's status.
  void Submit(std::string_view group, Collective c);

  // Removes the group at once (its name can be reused), fails its queued
  // calls with ABORTED and aborts its communicator. NOT_FOUND if unknown.
  absl::Status DestroyGroup(std::string_view name);

  absl::StatusOr<GroupInfo> GetGroup(std::string_view name) const;
  std::vector<GroupInfo> ListGroups() const;  // sorted by name

 private:
  struct Group;
  void RunExecutor(std::shared_ptr<Group> g, std::function<void(absl::StatusOr<GroupInfo>)> done,
                   JoinControl control);
  absl::StatusOr<std::unique_ptr<backend::Communicator>> Join(Group& g, const JoinControl& control);
  void Forget(const std::shared_ptr<Group>& g);
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const GroupRegistryOptions options_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  // Groups removed from groups_ whose executor may still be running.
  std::vector<std::shared_ptr<Group>> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qtx::server::collective

#endif  // QTX_SERVER_COLLECTIVE_GROUP_REGISTRY_H_

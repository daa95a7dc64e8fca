#include "server/collective/group_registry.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace qtx::server::collective {

std::string_view GroupStateName(GroupState s) {
  switch (s) {
    case GroupState::kJoining:
      return "JOINING";
    case GroupState::kReady:
      return "READY";
    case GroupState::kBroken:
      return "BROKEN";
  }
  return "UNKNOWN";
}

std::string_view CommBackendName(CommBackendKind b) {
  return b == CommBackendKind::kNccl ? "NCCL" : "GLOO";
}

struct GroupRegistry::Group {
  explicit Group(GroupSpec s) : spec(std::move(s)) {}

  GroupInfo Info() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return GroupInfo{spec.name, spec.rank,     spec.world_size, spec.backend,
                     state,     next_sequence, error,           spec.timeout};
  }
  std::string KeyBase() const { return absl::StrCat("qtx/group/", spec.name, "/"); }

  // Constant after construction.
  const GroupSpec spec;

  mutable absl::Mutex mu;
  GroupState state ABSL_GUARDED_BY(mu) = GroupState::kJoining;
  std::string error ABSL_GUARDED_BY(mu);
  uint64_t next_sequence ABSL_GUARDED_BY(mu) = 0;
  std::map<uint64_t, Collective> pending ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  // Set once READY; used by the executor, aborted from any thread.
  std::shared_ptr<backend::Communicator> comm ABSL_GUARDED_BY(mu);

  std::thread thread;  // assigned under the registry's mu_, joined once finished
  std::atomic<bool> finished{false};
};

namespace {

constexpr size_t kMaxNameBytes = 128;
// Joining waits in slices this long, checking for DestroyGroup, cancellation
// and shutdown between them.
constexpr absl::Duration kJoinSlice = absl::Milliseconds(200);
// How long a failed group's rendezvous keys stay readable on rank 0 (peers
// read "formed" to learn why) before they are erased.
constexpr absl::Duration kFailedKeysLinger = absl::Seconds(10);
// Ranks named in a join error; the rest are counted.
constexpr size_t kMaxNamedRanks = 5;
// Join keys peeked per store call when naming the missing ranks (the store
// names up to 8 missing keys per call).
constexpr int kPeekChunk = 8;

constexpr absl::string_view kFormedOk = "ok";
constexpr absl::string_view kFormedFailed = "failed:";
constexpr absl::string_view kFormedAborted = "aborted:";

std::string RandomSession() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                      static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  return absl::StrFormat("%016x", gen());
}

// Ranks in [first, first + count) whose join key appears in a store timeout
// message ("... not set before the deadline: k1, k2").
std::vector<int> MissingRanks(absl::string_view message, const std::string& join_prefix, int first,
                              int count) {
  std::vector<int> missing;
  for (int r = first; r < first + count; ++r) {
    const std::string key = absl::StrCat(join_prefix, r);
    size_t pos = 0;
    while ((pos = message.find(key, pos)) != absl::string_view::npos) {
      const size_t end = pos + key.size();
      if (end == message.size() || message[end] == ',' || message[end] == ' ' ||
          message[end] == ')') {
        missing.push_back(r);
        break;
      }
      pos = end;
    }
  }
  return missing;
}

// "rank(s) [2, 5] of world_size 8": the ranks of [from, world_size) whose
// join key is missing, read without waiting, chunk by chunk (O(1) memory).
std::string MissingRanksSummary(backend::RendezvousClient& store, const std::string& join_prefix,
                                int from, int world_size) {
  std::vector<int> named;
  int missing = 0;
  bool unknown = false;
  for (int first = from; first < world_size; first += kPeekChunk) {
    const int count = std::min(kPeekChunk, world_size - first);
    std::vector<std::string> keys;
    keys.reserve(count);
    for (int r = first; r < first + count; ++r) keys.push_back(absl::StrCat(join_prefix, r));
    auto v = store.Get(keys, absl::Now());
    if (v.ok()) continue;
    if (v.status().code() != absl::StatusCode::kDeadlineExceeded) {
      unknown = true;
      break;
    }
    for (int r : MissingRanks(v.status().message(), join_prefix, first, count)) {
      if (named.size() < kMaxNamedRanks) named.push_back(r);
      ++missing;
    }
  }
  std::string list = absl::StrJoin(named, ", ");
  if (missing > static_cast<int>(named.size())) {
    absl::StrAppend(&list, " and ", missing - static_cast<int>(named.size()), " more");
  }
  if (list.empty()) list = "unknown";
  if (unknown) absl::StrAppend(&list, ", possibly more");
  return absl::StrFormat("rank(s) [%s] of world_size %d", list, world_size);
}

// A RendezvousClient that waits in slices of kJoinSlice and gives up between
// two slices when `interrupted` returns an error (DestroyGroup, cancellation,
// shutdown). Used for the join and for the communicator's bootstrap.
class InterruptibleStore final : public backend::RendezvousClient {
 public:
  InterruptibleStore(backend::RendezvousClient& inner, std::function<absl::Status()> interrupted)
      : inner_(inner), interrupted_(std::move(interrupted)) {}

  absl::Status Set(std::string_view key, std::string_view value, absl::Time deadline) override {
    QTX_RETURN_IF_ERROR(interrupted_());
    return inner_.Set(key, value, deadline);
  }

  absl::StatusOr<std::vector<std::string>> Get(std::span<const std::string> keys,
                                               absl::Time deadline) override {
    for (;;) {
      QTX_RETURN_IF_ERROR(interrupted_());
      const absl::Time slice = std::min(deadline, absl::Now() + kJoinSlice);
      auto v = inner_.Get(keys, slice);
      if (v.ok() || v.status().code() != absl::StatusCode::kDeadlineExceeded ||
          absl::Now() >= deadline) {
        return v;
      }
    }
  }

 private:
  backend::RendezvousClient& inner_;
  const std::function<absl::Status()> interrupted_;
};

}  // namespace

NamespaceLimits GroupRendezvousBudget(int world_size) {
  const size_t w = static_cast<size_t>(std::max(world_size, 1));
  NamespaceLimits l;
  // Per rank: its join key, Gloo's address list and hostname keys, slack.
  l.max_keys = 4 * w + 64;
  // Gloo's address list is ~140 bytes per peer; the rest is small.
  l.max_bytes = w * (w * 160 + (size_t{16} << 10)) + (size_t{64} << 10);
  return l;
}

GroupRegistry::GroupRegistry(GroupRegistryOptions options) : options_(std::move(options)) {}

GroupRegistry::~GroupRegistry() {
  std::vector<std::shared_ptr<Group>> all;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, g] : groups_) all.push_back(g);
    groups_.clear();
    for (auto& g : retired_) all.push_back(g);
    retired_.clear();
  }
  for (auto& g : all) {
    std::shared_ptr<backend::Communicator> comm;
    {
      absl::MutexLock lock(&g->mu);
      g->stopping = true;
      comm = g->comm;
    }
    if (comm) comm->Abort();
  }
  for (auto& g : all) {
    if (g->thread.joinable()) g->thread.join();
  }
}

absl::Status GroupRegistry::ValidateSpec(const GroupSpec& spec) const {
  if (spec.name.empty()) return absl::InvalidArgumentError("name: must not be empty");
  if (spec.name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("name: %d bytes, at most %d allowed", spec.name.size(), kMaxNameBytes));
  }
  for (char c : spec.name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "name='%s': only letters, digits, '_', '-' and '.' are allowed", spec.name));
    }
  }
  if (spec.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("world_size=%d: must be >= 1", spec.world_size));
  }
  if (spec.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrFormat("world_size=%d: at most %d ranks per group",
                                                      spec.world_size, kMaxWorldSize));
  }
  if (spec.rank < 0 || spec.rank >= spec.world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank=%d: must be in [0, world_size=%d)", spec.rank, spec.world_size));
  }
  if (spec.rank > 0 && spec.coordinator.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "coordinator: empty on rank %d; ranks > 0 need the gRPC address of rank 0's sidecar",
        spec.rank));
  }
  if (spec.timeout <= absl::ZeroDuration() || spec.timeout > options_.max_timeout) {
    return absl::InvalidArgumentError(absl::StrFormat("timeout=%s: must be > 0 and <= %s",
                                                      absl::FormatDuration(spec.timeout),
                                                      absl::FormatDuration(options_.max_timeout)));
  }
  if (spec.rank == 0 && options_.local_store == nullptr) {
    return absl::FailedPreconditionError(
        "this sidecar hosts no rendezvous store, so it cannot be rank 0");
  }
  return absl::OkStatus();
}

void GroupRegistry::CreateGroup(GroupSpec spec, std::function<void(absl::StatusOr<GroupInfo>)> done,
                                JoinControl control) {
  if (absl::Status s = ValidateSpec(spec); !s.ok()) {
    done(s);
    return;
  }
  auto g = std::make_shared<Group>(std::move(spec));
  {
    absl::MutexLock lock(&mu_);
    ReapFinished();
    if (groups_.contains(g->spec.name)) {
      auto& existing = groups_.at(g->spec.name);
      absl::MutexLock glock(&existing->mu);
      const GroupInfo info = existing->Info();
      done(absl::AlreadyExistsError(absl::StrFormat(
          "group '%s' already exists on this sidecar (rank %d of %d, %s); destroy it first",
          info.name, info.rank, info.world_size, GroupStateName(info.state))));
      return;
    }
    if (groups_.size() >= static_cast<size_t>(options_.max_groups)) {
      done(absl::ResourceExhaustedError(absl::StrFormat(
          "this sidecar has %d groups (the limit); destroy unused groups", groups_.size())));
      return;
    }
    groups_.emplace(g->spec.name, g);
    g->thread =
        std::thread([this, g, done = std::move(done), control = std::move(control)]() mutable {
          RunExecutor(std::move(g), std::move(done), std::move(control));
        });
  }
}

absl::StatusOr<std::unique_ptr<backend::Communicator>> GroupRegistry::Join(
    Group& g, const JoinControl& control) {
  const GroupSpec& spec = g.spec;
  const absl::Time deadline = std::min(absl::Now() + spec.timeout, control.deadline);
  const std::string base = g.KeyBase();
  const std::string timeout_str = absl::FormatDuration(spec.timeout);
  auto interrupted = [&g, &control]() -> absl::Status {
    {
      absl::MutexLock lock(&g.mu);
      if (g.stopping) {
        return absl::AbortedError(
            absl::StrFormat("group '%s' was destroyed while joining", g.spec.name));
      }
    }
    if (control.cancelled != nullptr && control.cancelled->load()) {
      return absl::CancelledError(absl::StrFormat(
          "group '%s': CreateGroup was cancelled by the client while joining", g.spec.name));
    }
    return absl::OkStatus();
  };
  std::unique_ptr<backend::RendezvousClient> remote;
  backend::RendezvousClient* raw = nullptr;
  std::string session;
  if (spec.rank == 0) {
    raw = options_.local_store;
    options_.local_store->OpenNamespace(base, GroupRendezvousBudget(spec.world_size));
    session = RandomSession();
    QTX_RETURN_IF_ERROR(options_.local_store->Put(base + "session", session));
  } else {
    auto client = options_.connect(spec.coordinator);
    if (!client.ok()) {
      return absl::Status(client.status().code(),
                          absl::StrFormat("group '%s': coordinator '%s': %s", spec.name,
                                          spec.coordinator, client.status().message()));
    }
    remote = std::move(*client);
    raw = remote.get();
  }
  InterruptibleStore store(*raw, interrupted);
  if (spec.rank > 0) {
    const std::string keys[1] = {base + "session"};
    auto v = store.Get(keys, deadline);
    if (!v.ok()) {
      if (v.status().code() == absl::StatusCode::kDeadlineExceeded) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "group '%s': rank 0 did not create the group on the coordinator '%s' within %s "
            "(if rank 0 still has an older incarnation of it, destroy the group there too)",
            spec.name, spec.coordinator, timeout_str));
      }
      return absl::Status(v.status().code(),
                          absl::StrFormat("group '%s': rendezvous with coordinator '%s': %s",
                                          spec.name, spec.coordinator, v.status().message()));
    }
    session = (*v)[0];
  }
  const std::string prefix = absl::StrCat(base, session, "/");
  const std::string join_prefix = prefix + "join/";
  const std::string formed_key = prefix + "formed";
  QTX_RETURN_IF_ERROR(store.Set(absl::StrCat(join_prefix, spec.rank), "1", deadline));
  if (spec.rank == 0) {
    // Wait for the other ranks' join keys one at a time: O(1) memory.
    for (int r = 1; r < spec.world_size; ++r) {
      const std::string keys[1] = {absl::StrCat(join_prefix, r)};
      auto v = store.Get(keys, deadline);
      if (v.ok()) continue;
      absl::Status error = v.status();
      if (error.code() == absl::StatusCode::kDeadlineExceeded) {
        error = absl::DeadlineExceededError(absl::StrFormat(
            "group '%s': %s did not join within %s", spec.name,
            MissingRanksSummary(*raw, join_prefix, r, spec.world_size), timeout_str));
        (void)raw->Set(formed_key, absl::StrCat(kFormedFailed, error.message()), deadline);
      } else {
        (void)raw->Set(formed_key,
                       absl::StrCat(kFormedAborted, "rank 0 gave up: ", error.message()), deadline);
      }
      return error;
    }
    QTX_RETURN_IF_ERROR(raw->Set(formed_key, std::string(kFormedOk), deadline));
    // Joining is over: a rank re-creating the group must wait for the next
    // incarnation instead of joining this one.
    options_.local_store->Erase(base + "session");
  } else {
    const std::string keys[1] = {formed_key};
    auto v = store.Get(keys, deadline);
    if (!v.ok()) {
      if (v.status().code() == absl::StatusCode::kDeadlineExceeded) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "group '%s': %s did not join within %s", spec.name,
            MissingRanksSummary(*raw, join_prefix, 0, spec.world_size), timeout_str));
      }
      return absl::Status(v.status().code(), absl::StrFormat("group '%s': rendezvous: %s",
                                                             spec.name, v.status().message()));
    }
    const std::string& formed = (*v)[0];
    if (absl::StartsWith(formed, kFormedFailed)) {
      return absl::DeadlineExceededError(formed.substr(kFormedFailed.size()));
    }
    if (formed != kFormedOk) {
      return absl::AbortedError(absl::StrFormat("group '%s': %s", spec.name,
                                                absl::StartsWith(formed, kFormedAborted)
                                                    ? formed.substr(kFormedAborted.size())
                                                    : formed));
    }
  }
  return options_.make_communicator(spec, store, prefix + "comm/", deadline);
}

void GroupRegistry::Forget(const std::shared_ptr<Group>& g) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(g->spec.name);
  if (it != groups_.end() && it->second == g) {
    groups_.erase(it);
    retired_.push_back(g);
    // The session key goes at once, so that a rank retrying the group
    // cannot join this dead session; the other keys stay readable a little
    // longer (peers still waiting read "formed"), then the store erases them.
    if (g->spec.rank == 0 && options_.local_store != nullptr) {
      options_.local_store->Erase(g->KeyBase() + "session");
      options_.local_store->CloseNamespace(g->KeyBase(), absl::Now() + kFailedKeysLinger);
    }
  }
}

void GroupRegistry::ReapFinished() {
  for (auto it = retired_.begin(); it != retired_.end();) {
    if ((*it)->finished.load()) {
      if ((*it)->thread.joinable()) (*it)->thread.join();
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
}

void GroupRegistry::RunExecutor(std::shared_ptr<Group> g,
                                std::function<void(absl::StatusOr<GroupInfo>)> done,
                                JoinControl control) {
  auto comm = Join(*g, control);
  if (!comm.ok()) {
    Forget(g);
    done(comm.status());
    g->finished.store(true);
    return;
  }
  absl::StatusOr<GroupInfo> ready;
  {
    absl::MutexLock lock(&g->mu);
    if (g->stopping) {
      ready = absl::AbortedError(
          absl::StrFormat("group '%s' was destroyed while joining", g->spec.name));
    } else {
      g->comm = std::move(*comm);
      g->state = GroupState::kReady;
      ready = g->Info();
    }
  }
  done(std::move(ready));

  for (;;) {
    std::vector<std::pair<Collective, absl::Status>> failed;
    std::optional<Collective> next;
    std::shared_ptr<backend::Communicator> communicator;
    bool stop = false;
    {
      absl::MutexLock lock(&g->mu);
      absl::Time earliest = absl::InfiniteFuture();
      for (const auto& [seq, c] : g->pending) earliest = std::min(earliest, c.deadline);
      auto wake = [&g]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g->mu) {
        return g->stopping || g->pending.contains(g->next_sequence);
      };
      // Re-evaluated whenever a call is queued (Submit signals via mu).
      const size_t queued = g->pending.size();
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g->mu) {
        return wake() || g->pending.size() != queued;
      };
      g->mu.AwaitWithDeadline(absl::Condition(&changed), earliest);
      const absl::Time now = absl::Now();
      if (g->stopping) {
        for (auto& [seq, c] : g->pending) {
          failed.emplace_back(std::move(c), absl::AbortedError(absl::StrFormat(
                                                "group '%s' was destroyed", g->spec.name)));
        }
        g->pending.clear();
        stop = true;
      } else {
        for (auto it = g->pending.begin(); it != g->pending.end();) {
          if (it->first != g->next_sequence && it->second.deadline <= now) {
            failed.emplace_back(
                std::move(it->second),
                absl::FailedPreconditionError(absl::StrFormat(
                    "group '%s': sequence %d waited for its predecessors, but the group still "
                    "expects sequence %d next (calls %d..%d never arrived before the deadline)",
                    g->spec.name, it->first, g->next_sequence, g->next_sequence, it->first - 1)));
            it = g->pending.erase(it);
          } else {
            ++it;
          }
        }
        auto it = g->pending.find(g->next_sequence);
        if (it != g->pending.end()) {
          next = std::move(it->second);
          g->pending.erase(it);
          communicator = g->comm;
        }
      }
    }
    for (auto& [c, s] : failed) c.finish(s);
    if (stop) break;
    if (!next.has_value()) continue;

    CollectiveOutcome outcome = next->run(*communicator);
    failed.clear();
    {
      absl::MutexLock lock(&g->mu);
      ++g->next_sequence;
      if (outcome.group_broken && g->state != GroupState::kBroken) {
        g->state = GroupState::kBroken;
        g->error = std::string(outcome.status.message());
      }
      if (g->state == GroupState::kBroken) {
        for (auto& [seq, c] : g->pending) {
          failed.emplace_back(std::move(c),
                              absl::AbortedError(absl::StrFormat(
                                  "group '%s' is BROKEN (%s); destroy it and create a new one",
                                  g->spec.name, g->error)));
        }
        g->pending.clear();
      }
    }
    next->finish(outcome.status);
    for (auto& [c, s] : failed) c.finish(s);
  }
  g->finished.store(true);
}

void GroupRegistry::Submit(std::string_view group, Collective c) {
  std::shared_ptr<Group> g;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(std::string(group));
    if (it != groups_.end()) g = it->second;
  }
  if (g == nullptr) {
    c.finish(absl::NotFoundError(absl::StrFormat(
        "group '%s' does not exist on this sidecar; call CreateGroup first", group)));
    return;
  }
  absl::Status error;
  {
    absl::MutexLock lock(&g->mu);
    const uint64_t next = g->next_sequence;
    if (g->stopping) {
      error = absl::AbortedError(absl::StrFormat("group '%s' was destroyed", group));
    } else if (g->state == GroupState::kJoining) {
      error = absl::FailedPreconditionError(
          absl::StrFormat("group '%s' is still joining; wait for CreateGroup to return", group));
    } else if (g->state == GroupState::kBroken) {
      error = absl::AbortedError(absl::StrFormat(
          "group '%s' is BROKEN (%s); destroy it and create a new one", group, g->error));
    } else if (c.sequence < next) {
      error = absl::FailedPreconditionError(absl::StrFormat(
          "group '%s': sequence %d was already used; the group expects sequence %d next", group,
          c.sequence, next));
    } else if (c.sequence - next > options_.max_sequence_lookahead) {
      error = absl::FailedPreconditionError(absl::StrFormat(
          "group '%s': sequence %d is too far ahead; the group expects sequence %d next "
          "(at most %d calls may be queued ahead)",
          group, c.sequence, next, options_.max_sequence_lookahead));
    } else if (g->pending.contains(c.sequence)) {
      error = absl::FailedPreconditionError(absl::StrFormat(
          "group '%s': sequence %d is already queued by another call; the group expects "
          "sequence %d next",
          group, c.sequence, next));
    } else {
      g->pending.emplace(c.sequence, std::move(c));
      return;
    }
  }
  c.finish(error);
}

absl::Status GroupRegistry::DestroyGroup(std::string_view name) {
  std::shared_ptr<Group> g;
  {
    absl::MutexLock lock(&mu_);
    ReapFinished();
    auto it = groups_.find(std::string(name));
    if (it == groups_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("group '%s' does not exist on this sidecar", name));
    }
    g = it->second;
    groups_.erase(it);
    retired_.push_back(g);
  }
  std::shared_ptr<backend::Communicator> comm;
  {
    absl::MutexLock lock(&g->mu);
    g->stopping = true;
    comm = g->comm;
  }
  if (comm) comm->Abort();
  if (g->spec.rank == 0 && options_.local_store != nullptr) {
    options_.local_store->CloseNamespace(g->KeyBase());
  }
  return absl::OkStatus();
}

absl::StatusOr<GroupInfo> GroupRegistry::GetGroup(std::string_view name) const {
  std::shared_ptr<Group> g;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(std::string(name));
    if (it == groups_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("group '%s' does not exist on this sidecar", name));
    }
    g = it->second;
  }
  absl::MutexLock lock(&g->mu);
  return g->Info();
}

std::vector<GroupInfo> GroupRegistry::ListGroups() const {
  std::vector<std::shared_ptr<Group>> all;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, g] : groups_) all.push_back(g);
  }
  std::vector<GroupInfo> out;
  for (const auto& g : all) {
    absl::MutexLock lock(&g->mu);
    out.push_back(g->Info());
  }
  std::sort(out.begin(), out.end(),
            [](const GroupInfo& a, const GroupInfo& b) { return a.name < b.name; });
  return out;
}

}  // namespace qtx::server::collective

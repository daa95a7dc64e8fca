// KvStore: the in-memory key-value map behind qtx.v1.Rendezvous, hosted by the
// sidecar of each group's rank 0. Peers Set their bootstrap data (Gloo
// addresses, the NCCL unique id, join markers) and Get it, waiting until the
// keys exist.
//
// Waiting never blocks a thread of the caller's choosing: GetAsync registers a
// waiter and returns at once; its callback runs exactly once, when the last
// key arrives (on the thread that Set it), when the deadline passes (on the
// store's timer thread), when the waiter is cancelled (on the cancelling
// thread), or inline when everything is already present. Callbacks run
// without the store's lock held and may call back into the store.
//
// It also implements backend::RendezvousClient (blocking Set/Get), which rank
// 0's own group uses instead of a gRPC round trip to itself.
//
// Memory is bounded (issue 18 item 3). Keys live in namespaces: a namespace is
// a key prefix that the group registry opens for a group this sidecar is rank
// 0 of ("qtx/group/<name>/"), with its own budget of keys and bytes sized to
// the group (NamespaceLimits). With KvStoreLimits::require_namespace (qtxd
// sets it) a Put outside every open namespace fails with FAILED_PRECONDITION,
// so a client cannot park data under a group that does not exist here.
// Past a namespace's budget, past max_value_bytes or past max_total_bytes a
// Put fails with RESOURCE_EXHAUSTED. CloseNamespace refuses further Puts at
// once and erases the keys (at once, or at a given time on the timer thread,
// so that peers can still read why a group failed).
//
// Thread safety: safe for concurrent use. The destructor fails every waiter
// with CANCELLED and joins the timer thread.
#ifndef QTX_SERVER_COLLECTIVE_KV_STORE_H_
#define QTX_SERVER_COLLECTIVE_KV_STORE_H_

#include <cstdint>
#include <functional>
#include <span>
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

namespace qtx::server::collective {

struct KvStoreLimits {
  size_t max_key_bytes = 256;
  // Largest value. Gloo's address list of a 1024-rank group is ~140 KiB.
  size_t max_value_bytes = size_t{256} << 10;
  size_t max_keys = 100000;
  // Bytes of all keys and values together.
  size_t max_total_bytes = size_t{1} << 30;
  size_t max_keys_per_get = 64;
  size_t max_waiters = 4096;
  // Refuse Puts outside every open namespace (FAILED_PRECONDITION).
  bool require_namespace = false;
};

// Budget of one namespace: keys, and bytes of keys + values.
struct NamespaceLimits {
  size_t max_keys = 0;
  size_t max_bytes = 0;
};

class KvStore final : public backend::RendezvousClient {
 public:
  using WaiterId = uint64_t;
  using GetCallback = std::function<void(absl::StatusOr<std::vector<std::string>>)>;

  explicit KvStore(KvStoreLimits limits = {});
  ~KvStore() override;
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  // Stores `value` under `key` and wakes the waiters it completes.
  // INVALID_ARGUMENT for an empty or oversized key; RESOURCE_EXHAUSTED for an
  // oversized value, past the key's namespace budget, past max_total_bytes or
  // when the store holds max_keys keys already; FAILED_PRECONDITION when the
  // key's namespace is closed, or (require_namespace) when no open namespace
  // holds the key.
  absl::Status Put(std::string_view key, std::string_view value);

  // Opens the namespace `prefix` with `limits`, first erasing every key under
  // it (a previous incarnation's). Reopening a closed namespace is allowed.
  // REQUIRES: `prefix` is not empty, and no other open namespace is a prefix
  // of it or has it as a prefix.
  void OpenNamespace(std::string_view prefix, NamespaceLimits limits);

  // Refuses further Puts under `prefix` at once and erases its keys at
  // `erase_at` (at once when that has passed). No-op for an unknown prefix.
  void CloseNamespace(std::string_view prefix, absl::Time erase_at = absl::InfinitePast());

  // Removes the single key `key` if present.
  void Erase(std::string_view key);

  // Calls `done` once with the values of `keys` (in order) when all exist, or
  // DEADLINE_EXCEEDED naming the missing keys at `deadline`, or CANCELLED.
  // Argument errors (INVALID_ARGUMENT: no keys, too many, bad key;
  // RESOURCE_EXHAUSTED: too many waiters) are delivered through `done`, inline.
  // Returns an id for Cancel (0 when `done` already ran).
  WaiterId GetAsync(std::vector<std::string> keys, absl::Time deadline, GetCallback done);

  // Completes the waiter with CANCELLED if it is still waiting; else no-op.
  void Cancel(WaiterId id);

  // Removes every key that starts with `prefix` (a destroyed group's keys).
  // Returns how many were removed. Waiters are unaffected.
  size_t ErasePrefix(std::string_view prefix);

  size_t num_keys() const;
  size_t num_bytes() const;  // keys + values
  size_t num_waiters() const;
  size_t num_namespaces() const;  // open or closed, not yet erased

  // backend::RendezvousClient: blocking forms of Put and GetAsync.
  absl::Status Set(std::string_view key, std::string_view value, absl::Time deadline) override;
  absl::StatusOr<std::vector<std::string>> Get(std::span<const std::string> keys,
                                               absl::Time deadline) override;

 private:
  struct Waiter {
    std::vector<std::string> keys;
    absl::Time deadline;
    GetCallback done;
  };

  struct Namespace {
    NamespaceLimits limits;
    size_t keys = 0;
    size_t bytes = 0;
    bool closed = false;
    absl::Time erase_at = absl::InfiniteFuture();  // when closed
  };

  absl::Status CheckKey(std::string_view key) const;
  // The namespace holding `key` (the registered prefix of it), or end().
  absl::flat_hash_map<std::string, Namespace>::iterator FindNamespace(std::string_view key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases the keys under `prefix`, keeping the accounting right.
  size_t ErasePrefixLocked(std::string_view prefix) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseExpiredNamespaces(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when every key of `w` is present; fills `values` then.
  bool Ready(const Waiter& w, std::vector<std::string>* values) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string MissingKeys(const Waiter& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();

  // Constant after construction.
  const KvStoreLimits limits_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  size_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Namespace> namespaces_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WaiterId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  WaiterId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Bumped when a waiter or a namespace expiry arrives, to re-arm the timer.
  uint64_t timer_epoch_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread timer_;  // runs TimerLoop
};

}  // namespace qtx::server::collective

#endif  // QTX_SERVER_COLLECTIVE_KV_STORE_H_

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
  size_t max_key_bytes = 1024;
  size_t max_value_bytes = size_t{1} << 20;
  size_t max_keys = 100000;
  size_t max_keys_per_get = 4096;
  size_t max_waiters = 10000;
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
  // INVALID_ARGUMENT for an empty or oversized key or an oversized value;
  // RESOURCE_EXHAUSTED when the store holds max_keys keys already.
  absl::Status Put(std::string_view key, std::string_view value);

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
  size_t num_waiters() const;

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

  absl::Status CheckKey(std::string_view key) const;
  // True when every key of `w` is present; fills `values` then.
  bool Ready(const Waiter& w, std::vector<std::string>* values) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string MissingKeys(const Waiter& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();

  // Constant after construction.
  const KvStoreLimits limits_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WaiterId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  WaiterId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Bumped when a waiter with an earlier deadline arrives, to re-arm the timer.
  uint64_t timer_epoch_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread timer_;  // runs TimerLoop
};

}  // namespace qtx::server::collective

#endif  // QTX_SERVER_COLLECTIVE_KV_STORE_H_

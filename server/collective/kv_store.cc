#include "server/collective/kv_store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"

namespace qtx::server::collective {

KvStore::KvStore(KvStoreLimits limits) : limits_(limits) {
  timer_ = std::thread([this] { TimerLoop(); });
}

KvStore::~KvStore() {
  std::vector<GetCallback> cancelled;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, w] : waiters_) cancelled.push_back(std::move(w.done));
    waiters_.clear();
  }
  for (auto& done : cancelled) done(absl::CancelledError("rendezvous store is shutting down"));
  timer_.join();
}

absl::Status KvStore::CheckKey(std::string_view key) const {
  if (key.empty()) return absl::InvalidArgumentError("rendezvous key is empty");
  if (key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rendezvous key of %d bytes exceeds the limit of %d bytes", key.size(),
        limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

bool KvStore::Ready(const Waiter& w, std::vector<std::string>* values) const {
  for (const std::string& k : w.keys) {
    if (!values_.contains(k)) return false;
  }
  values->clear();
  values->reserve(w.keys.size());
  for (const std::string& k : w.keys) values->push_back(values_.at(k));
  return true;
}

std::string KvStore::MissingKeys(const Waiter& w) const {
  std::vector<std::string> missing;
  for (const std::string& k : w.keys) {
    if (!values_.contains(k)) missing.push_back(k);
  }
  return absl::StrJoin(missing, ", ");
}

absl::Status KvStore::Put(std::string_view key, std::string_view value) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rendezvous key '%s': value of %d bytes exceeds the limit of %d bytes", key,
        value.size(), limits_.max_value_bytes));
  }
  std::vector<std::pair<GetCallback, std::vector<std::string>>> ready;
  {
    absl::MutexLock lock(&mu_);
    auto it = values_.find(std::string(key));
    if (it == values_.end() && values_.size() >= limits_.max_keys) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "rendezvous store holds %d keys already (the limit); destroy unused groups",
          values_.size()));
    }
    values_[std::string(key)] = std::string(value);
    for (auto wit = waiters_.begin(); wit != waiters_.end();) {
      std::vector<std::string> vals;
      if (Ready(wit->second, &vals)) {
        ready.emplace_back(std::move(wit->second.done), std::move(vals));
        waiters_.erase(wit++);
      } else {
        ++wit;
      }
    }
  }
  for (auto& [done, vals] : ready) done(std::move(vals));
  return absl::OkStatus();
}

KvStore::WaiterId KvStore::GetAsync(std::vector<std::string> keys, absl::Time deadline,
                                    GetCallback done) {
  if (keys.empty()) {
    done(absl::InvalidArgumentError("rendezvous Get: no keys"));
    return 0;
  }
  if (keys.size() > limits_.max_keys_per_get) {
    done(absl::InvalidArgumentError(absl::StrFormat(
        "rendezvous Get: %d keys exceed the limit of %d", keys.size(),
        limits_.max_keys_per_get)));
    return 0;
  }
  for (const std::string& k : keys) {
    if (absl::Status s = CheckKey(k); !s.ok()) {
      done(s);
      return 0;
    }
  }
  Waiter w{std::move(keys), deadline, std::move(done)};
  std::vector<std::string> values;
  absl::Status error;
  WaiterId id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (Ready(w, &values)) {
      // Completed below, without the lock.
    } else if (absl::Now() >= deadline) {
      error = absl::DeadlineExceededError(
          absl::StrCat("rendezvous keys not set before the deadline: ", MissingKeys(w)));
    } else if (stopping_) {
      error = absl::CancelledError("rendezvous store is shutting down");
    } else if (waiters_.size() >= limits_.max_waiters) {
      error = absl::ResourceExhaustedError(absl::StrFormat(
          "rendezvous store has %d waiting Gets (the limit)", waiters_.size()));
    } else {
      id = next_id_++;
      waiters_.emplace(id, std::move(w));
      ++timer_epoch_;
      return id;
    }
  }
  if (error.ok()) {
    w.done(std::move(values));
  } else {
    w.done(error);
  }
  return 0;
}

void KvStore::Cancel(WaiterId id) {
  GetCallback done;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    done = std::move(it->second.done);
    waiters_.erase(it);
  }
  done(absl::CancelledError("rendezvous Get cancelled"));
}

size_t KvStore::ErasePrefix(std::string_view prefix) {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (auto it = values_.begin(); it != values_.end();) {
    if (absl::StartsWith(it->first, absl::string_view(prefix.data(), prefix.size()))) {
      values_.erase(it++);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

size_t KvStore::num_keys() const {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

size_t KvStore::num_waiters() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

void KvStore::TimerLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    absl::Time earliest = absl::InfiniteFuture();
    for (const auto& [id, w] : waiters_) earliest = std::min(earliest, w.deadline);
    const uint64_t epoch = timer_epoch_;
    auto changed = [this, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || timer_epoch_ != epoch;
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed), earliest);
    if (stopping_) break;
    const absl::Time now = absl::Now();
    std::vector<std::pair<GetCallback, std::string>> expired;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->second.deadline <= now) {
        expired.emplace_back(std::move(it->second.done), MissingKeys(it->second));
        waiters_.erase(it++);
      } else {
        ++it;
      }
    }
    if (expired.empty()) continue;
    mu_.Unlock();
    for (auto& [done, missing] : expired) {
      done(absl::DeadlineExceededError(
          absl::StrCat("rendezvous keys not set before the deadline: ", missing)));
    }
    mu_.Lock();
  }
}

absl::Status KvStore::Set(std::string_view key, std::string_view value, absl::Time /*deadline*/) {
  return Put(key, value);
}

absl::StatusOr<std::vector<std::string>> KvStore::Get(std::span<const std::string> keys,
                                                      absl::Time deadline) {
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> result;
  GetAsync(std::vector<std::string>(keys.begin(), keys.end()), deadline,
           [&](absl::StatusOr<std::vector<std::string>> r) {
             result = std::move(r);
             done.Notify();
           });
  done.WaitForNotification();
  return result;
}

}  // namespace qtx::server::collective

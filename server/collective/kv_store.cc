#include "server/collective/kv_store.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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
    return absl::InvalidArgumentError(
        absl::StrFormat("rendezvous key of %d bytes exceeds the limit of %d bytes", key.size(),
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
  // A few keys and a count: the message must stay deliverable.
  constexpr size_t kMaxNamed = 8;
  std::vector<std::string> named;
  size_t missing = 0;
  for (const std::string& k : w.keys) {
    if (values_.contains(k)) continue;
    if (named.size() < kMaxNamed) named.push_back(k);
    ++missing;
  }
  std::string out = absl::StrJoin(named, ", ");
  if (missing > named.size()) absl::StrAppend(&out, " and ", missing - named.size(), " more");
  return out;
}

absl::flat_hash_map<std::string, KvStore::Namespace>::iterator KvStore::FindNamespace(
    std::string_view key) {
  for (size_t pos = key.find('/'); pos != std::string_view::npos; pos = key.find('/', pos + 1)) {
    auto it = namespaces_.find(absl::string_view(key.data(), pos + 1));
    if (it != namespaces_.end()) return it;
  }
  return namespaces_.end();
}

size_t KvStore::ErasePrefixLocked(std::string_view prefix) {
  size_t n = 0;
  for (auto it = values_.begin(); it != values_.end();) {
    if (absl::StartsWith(it->first, absl::string_view(prefix.data(), prefix.size()))) {
      const size_t bytes = it->first.size() + it->second.size();
      total_bytes_ -= bytes;
      if (auto ns = FindNamespace(it->first); ns != namespaces_.end()) {
        ns->second.keys -= 1;
        ns->second.bytes -= bytes;
      }
      values_.erase(it++);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

void KvStore::OpenNamespace(std::string_view prefix, NamespaceLimits limits) {
  absl::MutexLock lock(&mu_);
  ErasePrefixLocked(prefix);
  Namespace& ns = namespaces_[std::string(prefix)];
  ns = Namespace{};
  ns.limits = limits;
}

void KvStore::CloseNamespace(std::string_view prefix, absl::Time erase_at) {
  absl::MutexLock lock(&mu_);
  auto it = namespaces_.find(std::string(prefix));
  if (it == namespaces_.end()) return;
  if (erase_at <= absl::Now()) {
    ErasePrefixLocked(prefix);
    namespaces_.erase(it);
    return;
  }
  it->second.closed = true;
  it->second.erase_at = erase_at;
  ++timer_epoch_;
}

void KvStore::EraseExpiredNamespaces(absl::Time now) {
  std::vector<std::string> expired;
  for (const auto& [prefix, ns] : namespaces_) {
    if (ns.closed && ns.erase_at <= now) expired.push_back(prefix);
  }
  for (const std::string& prefix : expired) {
    ErasePrefixLocked(prefix);
    namespaces_.erase(prefix);
  }
}

void KvStore::Erase(std::string_view key) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(std::string(key));
  if (it == values_.end()) return;
  const size_t bytes = it->first.size() + it->second.size();
  total_bytes_ -= bytes;
  if (auto ns = FindNamespace(it->first); ns != namespaces_.end()) {
    ns->second.keys -= 1;
    ns->second.bytes -= bytes;
  }
  values_.erase(it);
}

absl::Status KvStore::Put(std::string_view key, std::string_view value) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (value.size() > limits_.max_value_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("rendezvous key '%s': value of %d bytes exceeds the limit of %d bytes", key,
                        value.size(), limits_.max_value_bytes));
  }
  std::vector<std::pair<GetCallback, std::vector<std::string>>> ready;
  {
    absl::MutexLock lock(&mu_);
    auto ns = FindNamespace(key);
    if (ns == namespaces_.end() && limits_.require_namespace) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "rendezvous key '%s': no group is forming under it on this sidecar (keys are "
          "accepted only for groups this sidecar is rank 0 of, while they exist)",
          key));
    }
    if (ns != namespaces_.end() && ns->second.closed) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "rendezvous key '%s': the group's rendezvous is closed (it failed or was destroyed)",
          key));
    }
    auto it = values_.find(std::string(key));
    const size_t old_bytes = it == values_.end() ? 0 : key.size() + it->second.size();
    const size_t new_bytes = key.size() + value.size();
    if (it == values_.end() && values_.size() >= limits_.max_keys) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "rendezvous store holds %d keys already (the limit); destroy unused groups",
          values_.size()));
    }
    if (total_bytes_ - old_bytes + new_bytes > limits_.max_total_bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "rendezvous key '%s': the store holds %d bytes; %d more would pass its limit of %d "
          "bytes; destroy unused groups",
          key, total_bytes_, new_bytes, limits_.max_total_bytes));
    }
    if (ns != namespaces_.end()) {
      Namespace& n = ns->second;
      if (it == values_.end() && n.keys >= n.limits.max_keys) {
        return absl::ResourceExhaustedError(
            absl::StrFormat("rendezvous key '%s': group namespace '%s' holds %d keys (its limit)",
                            key, ns->first, n.keys));
      }
      if (n.bytes - old_bytes + new_bytes > n.limits.max_bytes) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "rendezvous key '%s': group namespace '%s' holds %d bytes; %d more would pass its "
            "limit of %d bytes",
            key, ns->first, n.bytes, new_bytes, n.limits.max_bytes));
      }
      if (it == values_.end()) ++n.keys;
      n.bytes = n.bytes - old_bytes + new_bytes;
    }
    total_bytes_ = total_bytes_ - old_bytes + new_bytes;
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
        "rendezvous Get: %d keys exceed the limit of %d", keys.size(), limits_.max_keys_per_get)));
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
      error = absl::ResourceExhaustedError(
          absl::StrFormat("rendezvous store has %d waiting Gets (the limit)", waiters_.size()));
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
  return ErasePrefixLocked(prefix);
}

size_t KvStore::num_keys() const {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

size_t KvStore::num_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

size_t KvStore::num_namespaces() const {
  absl::MutexLock lock(&mu_);
  return namespaces_.size();
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
    for (const auto& [prefix, ns] : namespaces_) {
      if (ns.closed) earliest = std::min(earliest, ns.erase_at);
    }
    const uint64_t epoch = timer_epoch_;
    auto changed = [this, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || timer_epoch_ != epoch;
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed), earliest);
    if (stopping_) break;
    const absl::Time now = absl::Now();
    EraseExpiredNamespaces(now);
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

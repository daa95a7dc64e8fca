#include "server/backend/gloo_communicator.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gloo/allgatherv.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

namespace qtx::server::backend {
namespace {

// Carries a RendezvousClient failure through Gloo's connectFullMesh, which
// only knows exceptions, back to Create().
struct StoreError : std::exception {
  explicit StoreError(absl::Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return "qtx rendezvous store error"; }
  absl::Status status;
};

// gloo::rendezvous::Store over a RendezvousClient. Every call is bounded by
// the bootstrap deadline and by the timeout Gloo passes to wait().
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(RendezvousClient& client, absl::Time deadline)
      : client_(client), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = client_.Set(key, std::string_view(data.data(), data.size()), deadline_);
    if (!s.ok()) throw StoreError(std::move(s));
  }

  std::vector<char> get(const std::string& key) override {
    const std::string keys[1] = {key};
    auto values = client_.Get(keys, deadline_);
    if (!values.ok()) throw StoreError(values.status());
    const std::string& v = (*values)[0];
    return std::vector<char>(v.begin(), v.end());
  }

  void wait(const std::vector<std::string>& keys) override { WaitUntil(keys, deadline_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    WaitUntil(keys, std::min(deadline_, absl::Now() + absl::FromChrono(timeout)));
  }

 private:
  void WaitUntil(const std::vector<std::string>& keys, absl::Time deadline) {
    auto values = client_.Get(keys, deadline);
    if (!values.ok()) throw StoreError(values.status());
  }

  RendezvousClient& client_;
  const absl::Time deadline_;
};

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// Runs `fn` (Gloo calls) and turns any exception into a Status prefixed with
// `what`. A timeout (Gloo says "Timed out") or a passed deadline becomes
// DEADLINE_EXCEEDED; other I/O errors UNAVAILABLE; anything else INTERNAL.
absl::Status Guard(const std::string& what, absl::Time deadline, const std::function<void()>& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const StoreError& e) {
    return absl::Status(e.status.code(), absl::StrCat(what, ": rendezvous: ", e.status.message()));
  } catch (const gloo::IoException& e) {
    const std::string msg = e.what();
    if (absl::StrContains(absl::AsciiStrToLower(msg), "timed out") || absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": a peer did not take part before the deadline (", msg, ")"));
    }
    return absl::UnavailableError(
        absl::StrCat(what, ": the connection to a peer failed (", msg, ")"));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(absl::StrCat(what, ": Gloo check failed: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, ": unknown exception from Gloo"));
  }
}

// Gloo's TCP transport sends with writev, which raises SIGPIPE when the peer
// has closed its end, and SIGPIPE's default action ends the process. qtxd
// ignores SIGPIPE in main; a process that runs a Gloo group in-process (the
// tests do) gets the same here, once, unless it installed a handler of its
// own. The failed write then reports EPIPE, and the group breaks with an
// error instead of killing the process (seen: a CI run of the group
// registry's tests under ASan died with SIGPIPE, session 18).
void IgnoreSigpipeUnlessHandled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

}  // namespace

// Registers a collective's Gloo buffers for Abort() while in scope.
class LiveBuffers {
 public:
  LiveBuffers(GlooCommunicator& comm, std::vector<gloo::transport::UnboundBuffer*> buffers)
      : comm_(comm) {
    absl::MutexLock lock(&comm_.mu_);
    comm_.live_ = std::move(buffers);
  }
  ~LiveBuffers() {
    absl::MutexLock lock(&comm_.mu_);
    comm_.live_.clear();
  }
  LiveBuffers(const LiveBuffers&) = delete;
  LiveBuffers& operator=(const LiveBuffers&) = delete;

 private:
  GlooCommunicator& comm_;
};

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    const GlooCommunicatorOptions& options) {
  const std::string name =
      absl::StrFormat("gloo[group=%s rank=%d/%d]", options.group, options.rank, options.world_size);
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: world_size=%d: must be >= 1", name, options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: rank=%d: must be in [0, %d)", name, options.rank, options.world_size));
  }
  if (options.store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no rendezvous store"));
  }
  if (options.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": empty host to listen on"));
  }
  const absl::Duration left = options.deadline - absl::Now();
  if (left <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError(absl::StrCat(name, ": deadline passed before connecting"));
  }

  IgnoreSigpipeUnlessHandled();
  std::shared_ptr<gloo::rendezvous::Context> context;
  absl::Status s = Guard(absl::StrCat(name, ": connecting"), options.deadline, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.host;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    StoreAdapter adapter(*options.store, options.deadline);
    gloo::rendezvous::PrefixStore prefixed(options.key_prefix, adapter);
    context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
    context->setTimeout(ToMillis(options.deadline - absl::Now()));
    context->connectFullMesh(prefixed, device);
  });
  if (!s.ok()) return s;
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(name, options.rank, options.world_size, std::move(context)));
}

GlooCommunicator::GlooCommunicator(std::string name, int rank, int world_size,
                                   std::shared_ptr<gloo::Context> context)
    : name_(std::move(name)), rank_(rank), world_size_(world_size), context_(std::move(context)) {}

GlooCommunicator::~GlooCommunicator() {
  // Tearing down the pairs must not throw out of a destructor.
  try {
    context_->closeConnections();
  } catch (...) {
  }
}

absl::StatusOr<absl::Duration> GlooCommunicator::Begin(const CommCall& call, const char* op) {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_reason_.empty()) {
      return absl::AbortedError(absl::StrFormat("%s: %s: unusable after an earlier failure: %s",
                                                name_, op, broken_reason_));
    }
  }
  if (aborted_.load()) {
    return absl::AbortedError(absl::StrFormat("%s: %s: the communicator was aborted", name_, op));
  }
  const absl::Duration left = call.deadline - absl::Now();
  if (left <= absl::ZeroDuration()) {
    return Fail(absl::DeadlineExceededError(
        absl::StrFormat("%s: %s: the deadline passed before the call began", name_, op)));
  }
  return std::max(left, absl::Milliseconds(1));
}

absl::Status GlooCommunicator::Fail(absl::Status status) {
  if (aborted_.load()) {
    // Abort() woke the call: whatever it returned, the group was destroyed.
    status = absl::AbortedError(absl::StrFormat(
        "%s: the communicator was aborted (its group was destroyed) during the call (%s)", name_,
        status.message()));
  }
  {
    absl::MutexLock lock(&mu_);
    if (broken_reason_.empty()) broken_reason_ = std::string(status.message());
  }
  try {
    context_->closeConnections();
  } catch (...) {
  }
  return status;
}

namespace {

// The start of every rank's first AllGatherV message.
struct FirstMessageHeader {
  uint64_t magic = 0x5653474f4c475451ULL;  // "QTGLOGSV"
  uint64_t sizes_digest = 0;               // FNV-1a 64 of the caller's recv_bytes
  uint64_t own_bytes = 0;                  // this rank's contribution
  uint64_t world = 0;
};

static_assert(sizeof(FirstMessageHeader) == GlooCommunicator::kFirstMessageHeaderBytes);

uint64_t SizesDigest(std::span<const uint64_t> sizes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (uint64_t v : sizes) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xFF)) * 0x100000001b3ULL;
  }
  return h;
}

}  // namespace

absl::Status GlooCommunicator::Allgatherv(const char* what, const void* in, void* out,
                                          const std::vector<size_t>& counts, absl::Duration left,
                                          const CommCall& call) {
  uint64_t total = 0;
  for (size_t c : counts) total += c;
  // Gloo wants real pointers even for empty contributions.
  char dummy = 0;
  char* in_ptr = counts[rank_] > 0 ? static_cast<char*>(const_cast<void*>(in)) : &dummy;
  const uint32_t tag = next_tag_++;
  absl::Status s = Guard(absl::StrCat(name_, ": ", what), call.deadline, [&] {
    gloo::AllgathervOptions opts(context_);
    // Buffers of our own (not made inside Gloo) so that Abort() can wake a
    // wait on a peer that never comes.
    std::unique_ptr<gloo::transport::UnboundBuffer> in_buf =
        context_->createUnboundBuffer(in_ptr, counts[rank_]);
    std::unique_ptr<gloo::transport::UnboundBuffer> out_buf =
        context_->createUnboundBuffer(out, total);
    LiveBuffers live(*this, {in_buf.get(), out_buf.get()});
    opts.setInput<char>(std::move(in_buf));
    opts.setOutput<char>(std::move(out_buf), counts);
    opts.setTag(tag);
    opts.setTimeout(ToMillis(left));
    gloo::allgatherv(opts);
  });
  // A woken wait may let Gloo return as if the bytes had come: never trust
  // a call that Abort() interrupted.
  if (s.ok() && aborted_.load()) s = absl::AbortedError("woken by Abort");
  return s;
}

absl::Status GlooCommunicator::AllGatherV(const void* send, std::span<const uint64_t> recv_bytes,
                                          void* recv, const CommCall& call) {
  if (recv_bytes.size() != static_cast<size_t>(world_size_)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: AllGatherV: recv_bytes has %d entries, expected world_size=%d", name_,
                        recv_bytes.size(), world_size_));
  }
  auto left = Begin(call, "AllGatherV");
  if (!left.ok()) return left.status();
  if (world_size_ == 1) {
    if (recv_bytes[0] > 0 && send != recv) std::memmove(recv, send, recv_bytes[0]);
    return absl::OkStatus();
  }
  std::vector<uint64_t> offsets(world_size_ + 1, 0);
  for (int r = 0; r < world_size_; ++r) offsets[r + 1] = offsets[r] + recv_bytes[r];
  const auto* src = static_cast<const char*>(send);
  auto* dst = static_cast<char*>(recv);

  // 1. The first message: fixed size on every rank whatever it was asked.
  constexpr uint64_t kRoom = kFirstMessageBytes - sizeof(FirstMessageHeader);
  auto head_of = [&](uint64_t bytes) { return std::min(bytes, kRoom); };
  std::vector<char> first(kFirstMessageBytes * (world_size_ + 1), 0);
  char* mine = first.data() + kFirstMessageBytes * world_size_;  // outside the output
  FirstMessageHeader h;
  h.sizes_digest = SizesDigest(recv_bytes);
  h.own_bytes = recv_bytes[rank_];
  h.world = static_cast<uint64_t>(world_size_);
  std::memcpy(mine, &h, sizeof h);
  if (head_of(recv_bytes[rank_]) > 0) {
    std::memcpy(mine + sizeof h, src, head_of(recv_bytes[rank_]));
  }
  absl::Status s = Allgatherv("AllGatherV", mine, first.data(),
                              std::vector<size_t>(world_size_, kFirstMessageBytes), *left, call);
  if (!s.ok()) return Fail(std::move(s));
  for (int r = 0; r < world_size_; ++r) {
    FirstMessageHeader p;
    std::memcpy(&p, first.data() + kFirstMessageBytes * r, sizeof p);
    if (p.magic != h.magic || p.world != h.world || p.sizes_digest != h.sizes_digest ||
        p.own_bytes != recv_bytes[r]) {
      // Every rank took part in the same fixed-size message: the transport
      // is in step, only this call fails (on every rank, each seeing the
      // disagreement).
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: AllGatherV: the ranks passed different sizes (rank %d contributes %d bytes, this "
          "rank expected %d%s)",
          name_, r, p.own_bytes, recv_bytes[r],
          p.sizes_digest != h.sizes_digest ? ", and its list of sizes differs" : ""));
    }
  }
  for (int r = 0; r < world_size_; ++r) {
    const uint64_t n = head_of(recv_bytes[r]);
    char* to = dst + offsets[r];
    const char* from = first.data() + kFirstMessageBytes * r + sizeof h;
    if (n > 0 && to != from) std::memmove(to, from, n);
  }

  // 2. The rest of the contributions longer than the first message's room,
  // in sizes every rank has agreed on.
  std::vector<size_t> rest(world_size_);
  uint64_t rest_total = 0;
  for (int r = 0; r < world_size_; ++r) {
    rest[r] = recv_bytes[r] - head_of(recv_bytes[r]);
    rest_total += rest[r];
  }
  if (rest_total == 0) return absl::OkStatus();
  // Gathered contiguously, then moved to their places (each rank's rest
  // follows its first bytes in `recv`). Our own rest is copied out first:
  // `send` may lie inside `recv`.
  std::vector<char> own(src + head_of(recv_bytes[rank_]), src + recv_bytes[rank_]);
  std::vector<char> gathered(rest_total);
  left = Begin(call, "AllGatherV");
  if (!left.ok()) return left.status();
  s = Allgatherv("AllGatherV", own.data(), gathered.data(), rest, *left, call);
  if (!s.ok()) return Fail(std::move(s));
  uint64_t at = 0;
  for (int r = 0; r < world_size_; ++r) {
    if (rest[r] > 0) std::memcpy(dst + offsets[r] + kRoom, gathered.data() + at, rest[r]);
    at += rest[r];
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduceMax(float* data, uint64_t count, const CommCall& call) {
  auto left = Begin(call, "AllReduceMax");
  if (!left.ok()) return left.status();
  if (count == 0 || world_size_ == 1) return absl::OkStatus();
  const uint32_t tag = next_tag_++;
  absl::Status s = Guard(absl::StrCat(name_, ": AllReduceMax"), call.deadline, [&] {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput<float>(data, count);
    opts.setReduceFunction(
        [](void* c, const void* a, const void* b, size_t n) { gloo::max<float>(c, a, b, n); });
    opts.setTag(tag);
    opts.setTimeout(ToMillis(*left));
    gloo::allreduce(opts);
  });
  return s.ok() ? s : Fail(std::move(s));
}

absl::Status GlooCommunicator::Barrier(const CommCall& call) {
  auto left = Begin(call, "Barrier");
  if (!left.ok()) return left.status();
  if (world_size_ == 1) return absl::OkStatus();
  const uint32_t tag = next_tag_++;
  absl::Status s = Guard(absl::StrCat(name_, ": Barrier"), call.deadline, [&] {
    gloo::BarrierOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(ToMillis(*left));
    gloo::barrier(opts);
  });
  return s.ok() ? s : Fail(std::move(s));
}

void GlooCommunicator::Abort() {
  aborted_.store(true);
  // Wake the collective in progress, if any: each wake ends one wait of it
  // (Gloo then goes on to its next step, which may wait again), so keep
  // waking until it has returned, for at most a few seconds.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (live_.empty()) return;
      for (gloo::transport::UnboundBuffer* b : live_) {
        b->abortWaitRecv();
        b->abortWaitSend();
      }
    }
    if (absl::Now() > give_up) return;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

}  // namespace qtx::server::backend

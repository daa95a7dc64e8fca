// qtxd's fd socket (server/api/fd_inbox.h) driven by the client's sender
// (client/qtx/fd_passing.h): descriptors arrive and are claimed once by
// token, tokens expire, bad peers and malformed messages are refused with a
// status that says why, and a closed connection ends its session.
#include "server/api/fd_inbox.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/fd_passing.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::api {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

// A memfd holding `text`; closed on destruction.
struct MemFile {
  explicit MemFile(const std::string& text) : fd(::memfd_create("fd-inbox-test", MFD_CLOEXEC)) {
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  }
  ~MemFile() { ::close(fd); }
  ino_t inode() const {
    struct stat st;
    EXPECT_EQ(::fstat(fd, &st), 0);
    return st.st_ino;
  }
  int fd;
};

ino_t InodeOf(int fd) {
  struct stat st;
  EXPECT_EQ(::fstat(fd, &st), 0);
  return st.st_ino;
}

std::string TempSocketPath() {
  char dir[] = "/tmp/qtx-fdinbox-XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return std::string(dir) + "/q.sock.fd";
}

struct Sessions {
  absl::Mutex mu;
  std::vector<uint64_t> closed;
};

class FdInboxTest : public ::testing::Test {
 protected:
  std::unique_ptr<FdInbox> Start(FdInboxOptions o) {
    o.socket_path = path_;
    o.on_session_closed = [this](uint64_t s) {
      absl::MutexLock lock(&sessions_.mu);
      sessions_.closed.push_back(s);
    };
    auto inbox = FdInbox::Create(std::move(o));
    EXPECT_TRUE(inbox.ok()) << inbox.status();
    return inbox.ok() ? *std::move(inbox) : nullptr;
  }
  std::unique_ptr<FdPassingConnection> Connect() {
    auto c = FdPassingConnection::Connect(path_);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  // Waits (up to 5 s) until session `s` was reported closed.
  bool WaitClosed(uint64_t s) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (absl::Now() < deadline) {
      {
        absl::MutexLock lock(&sessions_.mu);
        for (uint64_t c : sessions_.closed) {
          if (c == s) return true;
        }
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }

  std::string path_ = TempSocketPath();
  Sessions sessions_;
};

TEST_F(FdInboxTest, DescriptorsArriveAndAreClaimedOnceByToken) {
  auto inbox = Start({});
  ASSERT_NE(inbox, nullptr);
  struct stat st;
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto conn = Connect();
  MemFile a("alpha"), b("beta");
  const int fds[] = {a.fd, b.fd};
  QTX_ASSERT_OK_AND_ASSIGN(std::string token, conn->Send(fds));
  EXPECT_EQ(token.size(), kFdPassingTokenBytes);
  EXPECT_EQ(inbox->pending_fds(), 2u);
  QTX_ASSERT_OK_AND_ASSIGN(ClaimedFds claimed, inbox->Claim({token}));
  ASSERT_EQ(claimed.fds.size(), 2u);
  // The very files sent, in order.
  EXPECT_EQ(InodeOf(claimed.fds[0].get()), a.inode());
  EXPECT_EQ(InodeOf(claimed.fds[1].get()), b.inode());
  char buf[8] = {};
  EXPECT_EQ(::pread(claimed.fds[1].get(), buf, 4, 0), 4);
  EXPECT_EQ(std::string(buf, 4), "beta");
  EXPECT_TRUE(inbox->IsSessionOpen(claimed.session));
  EXPECT_EQ(inbox->pending_fds(), 0u);
  // One-time.
  EXPECT_THAT(inbox->Claim({token}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("already claimed")));
  // Two batches make one claim, in the order named.
  QTX_ASSERT_OK_AND_ASSIGN(std::string t1, conn->Send(std::vector<int>{b.fd}));
  QTX_ASSERT_OK_AND_ASSIGN(std::string t2, conn->Send(std::vector<int>{a.fd}));
  EXPECT_NE(t1, t2);
  QTX_ASSERT_OK_AND_ASSIGN(ClaimedFds two, inbox->Claim({t2, t1}));
  ASSERT_EQ(two.fds.size(), 2u);
  EXPECT_EQ(InodeOf(two.fds[0].get()), a.inode());
  EXPECT_EQ(InodeOf(two.fds[1].get()), b.inode());
}

TEST_F(FdInboxTest, BadTokensAreRefusedWithoutConsumingGoodOnes) {
  auto inbox = Start({});
  auto conn = Connect();
  MemFile a("a");
  QTX_ASSERT_OK_AND_ASSIGN(std::string token, conn->Send(std::vector<int>{a.fd}));
  EXPECT_THAT(inbox->Claim({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(inbox->Claim({"short"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("5 bytes, must be 16")));
  EXPECT_THAT(inbox->Claim({token, std::string(16, 'z')}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("fd_tokens[1]")));
  EXPECT_THAT(inbox->Claim({token, token}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeats")));
  // Still there after the failed claims.
  EXPECT_EQ(inbox->pending_fds(), 1u);
  QTX_ASSERT_OK(inbox->Claim({token}).status());
}

TEST_F(FdInboxTest, TokensFromTwoConnectionsDoNotMakeOneRegion) {
  auto inbox = Start({});
  auto c1 = Connect();
  auto c2 = Connect();
  MemFile a("a");
  QTX_ASSERT_OK_AND_ASSIGN(std::string t1, c1->Send(std::vector<int>{a.fd}));
  QTX_ASSERT_OK_AND_ASSIGN(std::string t2, c2->Send(std::vector<int>{a.fd}));
  EXPECT_THAT(inbox->Claim({t1, t2}), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("another fd-socket connection")));
}

TEST_F(FdInboxTest, UnclaimedTokensExpireAndTheirDescriptorsClose) {
  FdInboxOptions o;
  o.token_ttl = absl::Milliseconds(200);
  auto inbox = Start(o);
  auto conn = Connect();
  MemFile a("a");
  QTX_ASSERT_OK_AND_ASSIGN(std::string token, conn->Send(std::vector<int>{a.fd, a.fd}));
  EXPECT_EQ(inbox->pending_fds(), 2u);
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_EQ(inbox->pending_fds(), 0u);
  EXPECT_THAT(inbox->Claim({token}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("expired")));
  // The connection still works.
  QTX_ASSERT_OK(conn->Send(std::vector<int>{a.fd}).status());
}

TEST_F(FdInboxTest, PendingDescriptorsAreBounded) {
  FdInboxOptions o;
  o.max_pending_fds = 3;
  auto inbox = Start(o);
  auto conn = Connect();
  MemFile a("a");
  QTX_ASSERT_OK_AND_ASSIGN(std::string t1, conn->Send(std::vector<int>{a.fd, a.fd}));
  EXPECT_THAT(conn->Send(std::vector<int>{a.fd, a.fd}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit 3")));
  EXPECT_EQ(inbox->pending_fds(), 2u);
  QTX_ASSERT_OK(inbox->Claim({t1}).status());
  QTX_ASSERT_OK(conn->Send(std::vector<int>{a.fd, a.fd}).status());
}

TEST_F(FdInboxTest, APeerOfAnotherUserIsRefused) {
  FdInboxOptions o;
  o.allowed_uid = ::geteuid() + 4242;
  o.allow_root = false;
  auto inbox = Start(o);
  auto conn = Connect();
  MemFile a("a");
  EXPECT_THAT(conn->Send(std::vector<int>{a.fd}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("its own user")));
  // Disconnected: nothing more gets through.
  EXPECT_THAT(conn->Send(std::vector<int>{a.fd}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("fd socket")));
  EXPECT_EQ(inbox->pending_fds(), 0u);
}

// qtxd refuses such a peer at once and closes the connection; a Send made
// after that (the pipe is broken) still reports qtxd's reason, which is
// waiting in the socket, not the broken pipe.
TEST_F(FdInboxTest, APeerOfAnotherUserHearsWhyEvenAfterQtxdClosed) {
  FdInboxOptions o;
  o.allowed_uid = ::geteuid() + 4242;
  o.allow_root = false;
  auto inbox = Start(o);
  auto conn = Connect();
  absl::SleepFor(absl::Milliseconds(300));  // qtxd has answered and closed by now
  MemFile a("a");
  EXPECT_THAT(conn->Send(std::vector<int>{a.fd}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("its own user")));
  EXPECT_EQ(inbox->pending_fds(), 0u);
}

// Raw request header fields.
std::string Header(uint32_t magic, uint32_t version, uint32_t count, size_t length = 16) {
  std::string h(length, '\0');
  auto put = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4 && at + i < h.size(); ++i) h[at + i] = static_cast<char>(v >> (8 * i));
  };
  put(0, magic);
  put(4, version);
  put(8, count);
  return h;
}

TEST_F(FdInboxTest, MalformedMessagesAreRefusedAndEndTheConnection) {
  auto inbox = Start({});
  MemFile a("a");
  struct Case {
    std::string bytes;
    std::vector<int> fds;
    std::string why;
  };
  const Case cases[] = {
      {Header(0x12345678, 1, 1), {a.fd}, "bad magic"},
      {Header(kFdPassingMagic, 9, 1), {a.fd}, "protocol version 9"},
      {Header(kFdPassingMagic, 1, 0), {}, "descriptor count 0"},
      {Header(kFdPassingMagic, 1, 2), {a.fd}, "announces 2 descriptors but 1 are attached"},
      {Header(kFdPassingMagic, 1, 1), {}, "announces 1 descriptors but 0 are attached"},
      {Header(kFdPassingMagic, 1, 1, 8), {a.fd}, "exactly 16 bytes"},
      {Header(kFdPassingMagic, 1, 1, 40), {a.fd}, "exactly 16 bytes"},
      {Header(kFdPassingMagic, 1, 251), std::vector<int>(251, a.fd), "count 251"},
  };
  for (const Case& c : cases) {
    auto conn = Connect();
    EXPECT_THAT(conn->SendRawForTesting(c.bytes, c.fds),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.why)))
        << c.why;
    // The connection is over.
    EXPECT_THAT(conn->Send(std::vector<int>{a.fd}),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("fd socket")));
  }
  EXPECT_EQ(inbox->pending_fds(), 0u);
  // The client refuses bad counts itself.
  auto conn = Connect();
  EXPECT_THAT(conn->Send({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1..250")));
  EXPECT_THAT(conn->Send(std::vector<int>(kMaxFdsPerBatch + 1, a.fd)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("251 descriptors")));
}

TEST_F(FdInboxTest, AClosedConnectionEndsItsSession) {
  FdInboxOptions o;
  o.session_grace = absl::ZeroDuration();
  auto inbox = Start(o);
  auto conn = Connect();
  MemFile a("a");
  QTX_ASSERT_OK_AND_ASSIGN(std::string claimed_token, conn->Send(std::vector<int>{a.fd}));
  QTX_ASSERT_OK_AND_ASSIGN(std::string waiting, conn->Send(std::vector<int>{a.fd}));
  QTX_ASSERT_OK_AND_ASSIGN(ClaimedFds claimed, inbox->Claim({claimed_token}));
  const uint64_t session = claimed.session;
  EXPECT_TRUE(inbox->IsSessionOpen(session));
  conn.reset();  // the client goes away (as when it dies)
  ASSERT_TRUE(WaitClosed(session));
  EXPECT_FALSE(inbox->IsSessionOpen(session));
  // Its unclaimed descriptors went with it.
  EXPECT_EQ(inbox->pending_fds(), 0u);
  EXPECT_THAT(inbox->Claim({waiting}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("closed")));
  // A second server on the same live path is refused; after destruction the
  // socket file is gone.
  FdInboxOptions again;
  again.socket_path = path_;
  EXPECT_THAT(FdInbox::Create(again).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  inbox.reset();
  struct stat st;
  EXPECT_NE(::stat(path_.c_str(), &st), 0);
}

TEST_F(FdInboxTest, TheSessionCallbackComesAfterTheGrace) {
  FdInboxOptions o;
  o.session_grace = absl::Milliseconds(400);
  auto inbox = Start(o);
  auto conn = Connect();
  MemFile a("a");
  QTX_ASSERT_OK_AND_ASSIGN(std::string token, conn->Send(std::vector<int>{a.fd}));
  QTX_ASSERT_OK_AND_ASSIGN(ClaimedFds claimed, inbox->Claim({token}));
  const absl::Time closed = absl::Now();
  conn.reset();
  // Closed at once for IsSessionOpen, the callback only after the grace.
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (inbox->IsSessionOpen(claimed.session) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_FALSE(inbox->IsSessionOpen(claimed.session));
  {
    absl::MutexLock lock(&sessions_.mu);
    EXPECT_TRUE(sessions_.closed.empty()) << "the callback came before the grace";
  }
  ASSERT_TRUE(WaitClosed(claimed.session));
  EXPECT_GE(absl::Now() - closed, absl::Milliseconds(390));
}

TEST(FdPassing, SocketPathFollowsTheUnixTarget) {
  QTX_ASSERT_OK_AND_ASSIGN(std::string p, FdSocketPathForTarget("unix:///run/qtx/q.sock"));
  EXPECT_EQ(p, "/run/qtx/q.sock.fd");
  QTX_ASSERT_OK_AND_ASSIGN(p, FdSocketPathForTarget("unix:rel.sock"));
  EXPECT_EQ(p, "rel.sock.fd");
  EXPECT_THAT(FdSocketPathForTarget("localhost:50051"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unix socket")));
  EXPECT_THAT(FdPassingConnection::Connect("/nonexistent/qtx.sock.fd").status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot connect")));
}

}  // namespace
}  // namespace qtx::server::api

// GlooCommunicator on loopback: ranks are threads of this process, the
// rendezvous store a KvStore.
#include "server/backend/gloo_communicator.h"

#include <signal.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/kv_store.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::backend {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<std::unique_ptr<GlooCommunicator>> Connect(collective::KvStore& store, int world,
                                                       const std::string& prefix,
                                                       absl::Duration timeout) {
  std::vector<std::unique_ptr<GlooCommunicator>> comms(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      GlooCommunicatorOptions o;
      o.group = "t";
      o.rank = r;
      o.world_size = world;
      o.key_prefix = prefix;
      o.store = &store;
      o.deadline = absl::Now() + timeout;
      auto c = GlooCommunicator::Create(o);
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  return comms;
}

template <typename F>
void OnEveryRank(int world, F f) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { f(r); });
  for (auto& t : threads) t.join();
}

TEST(GlooCommunicator, AllGatherVWithEmptyAndUnequalContributions) {
  collective::KvStore store;
  const int world = 4;
  auto comms = Connect(store, world, "a/", absl::Seconds(10));
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  const std::vector<uint64_t> sizes = {3, 0, 1000, 17};
  const uint64_t total = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
  OnEveryRank(world, [&](int r) {
    std::vector<uint8_t> send(sizes[r]);
    for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint8_t>(r * 31 + i);
    std::vector<uint8_t> recv(total, 0);
    QTX_EXPECT_OK(comms[r]->AllGatherV(send.empty() ? nullptr : send.data(), sizes, recv.data(),
                                       {absl::Now() + absl::Seconds(10)}));
    uint64_t off = 0;
    for (int q = 0; q < world; ++q) {
      for (uint64_t i = 0; i < sizes[q]; ++i) {
        ASSERT_EQ(recv[off + i], static_cast<uint8_t>(q * 31 + i)) << "rank " << r;
      }
      off += sizes[q];
    }
  });
  OnEveryRank(world, [&](int r) {
    std::vector<float> v = {float(r), -float(r), 1.0f, r == 2 ? 100.0f : 0.0f};
    QTX_EXPECT_OK(comms[r]->AllReduceMax(v.data(), v.size(), {absl::Now() + absl::Seconds(10)}));
    EXPECT_THAT(v, ::testing::ElementsAre(3.0f, 0.0f, 1.0f, 100.0f));
    QTX_EXPECT_OK(comms[r]->Barrier({absl::Now() + absl::Seconds(10)}));
  });
  EXPECT_THAT(comms[0]->AllGatherV(nullptr, std::vector<uint64_t>{1, 2}, nullptr, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gloo[group=t rank=0/4]")));
}

// Contributions longer than the first message (GlooCommunicator::
// kFirstMessageBytes) take a second Gloo all-gather; in place too.
TEST(GlooCommunicator, AllGatherVBeyondTheFirstMessageAndInPlace) {
  collective::KvStore store;
  const int world = 3;
  auto comms = Connect(store, world, "l/", absl::Seconds(10));
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  const uint64_t room =
      GlooCommunicator::kFirstMessageBytes - GlooCommunicator::kFirstMessageHeaderBytes;
  const std::vector<uint64_t> sizes = {room, room + 1, 3 * room + 5};
  const uint64_t total = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
  for (bool in_place : {false, true}) {
    OnEveryRank(world, [&](int r) {
      std::vector<uint8_t> recv(total, 0);
      const uint64_t mine = std::accumulate(sizes.begin(), sizes.begin() + r, uint64_t{0});
      std::vector<uint8_t> send(sizes[r]);
      for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint8_t>(r * 7 + i * 13);
      uint8_t* from = send.data();
      if (in_place) {
        std::memcpy(recv.data() + mine, send.data(), send.size());
        from = recv.data() + mine;
      }
      QTX_EXPECT_OK(
          comms[r]->AllGatherV(from, sizes, recv.data(), {absl::Now() + absl::Seconds(10)}));
      uint64_t off = 0;
      for (int q = 0; q < world; ++q) {
        for (uint64_t i = 0; i < sizes[q]; ++i) {
          ASSERT_EQ(recv[off + i], static_cast<uint8_t>(q * 7 + i * 13))
              << "rank " << r << " from " << q << " byte " << i;
        }
        off += sizes[q];
      }
    });
  }
}

// Ranks that pass different sizes (Gloo alone would terminate the process on
// the receiving side) all fail with INVALID_ARGUMENT, in step: the
// communicator works afterwards.
TEST(GlooCommunicator, AllGatherVWithDisagreeingSizesFailsEveryRankInStep) {
  collective::KvStore store;
  const int world = 2;
  auto comms = Connect(store, world, "d/", absl::Seconds(10));
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  const std::vector<std::vector<uint64_t>> views = {{100, 20000}, {100, 200}};
  OnEveryRank(world, [&](int r) {
    const std::vector<uint64_t>& sizes = views[r];
    std::vector<uint8_t> send(sizes[r], 1), recv(sizes[0] + sizes[1]);
    EXPECT_THAT(
        comms[r]->AllGatherV(send.data(), sizes, recv.data(), {absl::Now() + absl::Seconds(10)}),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("the ranks passed different sizes")));
  });
  OnEveryRank(world, [&](int r) {
    const std::vector<uint64_t> sizes = {100, 20000};
    std::vector<uint8_t> send(sizes[r], static_cast<uint8_t>(r + 1)), recv(20100);
    QTX_EXPECT_OK(
        comms[r]->AllGatherV(send.data(), sizes, recv.data(), {absl::Now() + absl::Seconds(10)}));
    EXPECT_EQ(recv[0], 1);
    EXPECT_EQ(recv[20099], 2);
  });
}

TEST(GlooCommunicator, MissingPeerTimesOutAndBreaksTheCommunicator) {
  collective::KvStore store;
  auto comms = Connect(store, 2, "b/", absl::Seconds(10));
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  const absl::Time start = absl::Now();
  absl::Status s = comms[0]->Barrier({start + absl::Milliseconds(300)});
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(s,
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("gloo[group=t rank=0/2]")));
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_THAT(comms[0]->Barrier({absl::Now() + absl::Seconds(1)}),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("earlier failure")));
}

TEST(GlooCommunicator, CreateTimesOutWhenAPeerNeverPublishes) {
  collective::KvStore store;
  GlooCommunicatorOptions o;
  o.group = "t";
  o.rank = 0;
  o.world_size = 2;
  o.key_prefix = "c/";
  o.store = &store;
  o.deadline = absl::Now() + absl::Milliseconds(300);
  EXPECT_THAT(GlooCommunicator::Create(o),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("gloo[group=t rank=0/2]")));
}

// A peer that goes away while this rank sends to it: the send reports an
// error naming the communicator, and the process lives on. (Whether Gloo's
// write then meets the closed socket, where SIGPIPE would end a process that
// had not ignored it, depends on timing; the death test below checks that
// Create() ignores SIGPIPE. A CI run of the group registry's tests died of
// SIGPIPE before it did.)
TEST(GlooCommunicator, PeerGoneMidSendIsAnErrorNotASignal) {
  collective::KvStore store;
  auto comms = Connect(store, 2, "p/", absl::Seconds(10));
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  comms[1].reset();  // closes rank 1's connections
  // Several megabytes: more than the sockets' buffers hold, so rank 0 keeps
  // writing after the peer has closed.
  const std::vector<uint64_t> sizes = {uint64_t{16} << 20, uint64_t{16} << 20};
  std::vector<uint8_t> send(sizes[0], 7), recv(sizes[0] + sizes[1]);
  const absl::Status s =
      comms[0]->AllGatherV(send.data(), sizes, recv.data(), {absl::Now() + absl::Seconds(5)});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("gloo[group=t rank=0/2]"));
}

// In a fresh process (death-test child): the first Create() sets SIGPIPE from
// its default action to ignored, and keeps a handler the process installed.
void ExitWithSigpipeAfterCreate(bool own_handler) {
  if (own_handler)
    signal(
        SIGPIPE, +[](int) {});
  const sighandler_t before = signal(SIGPIPE, SIG_DFL);
  signal(SIGPIPE, before);
  collective::KvStore store;
  auto comms = Connect(store, 1, "s/", absl::Seconds(10));
  struct sigaction now {};
  sigaction(SIGPIPE, nullptr, &now);
  const bool ok =
      comms[0] != nullptr && (own_handler ? now.sa_handler == before : now.sa_handler == SIG_IGN);
  std::_Exit(ok ? 0 : 1);
}

TEST(GlooCommunicatorDeathTest, CreateIgnoresSigpipeUnlessTheProcessHandlesIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: Create() not yet called
  EXPECT_EXIT(ExitWithSigpipeAfterCreate(false), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(ExitWithSigpipeAfterCreate(true), ::testing::ExitedWithCode(0), "");
}

TEST(GlooCommunicator, RejectsBadOptions) {
  GlooCommunicatorOptions o;
  o.world_size = 2;
  o.rank = 2;
  EXPECT_THAT(GlooCommunicator::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank=2")));
  o.rank = 0;
  EXPECT_THAT(GlooCommunicator::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no rendezvous store")));
}

}  // namespace
}  // namespace qtx::server::backend

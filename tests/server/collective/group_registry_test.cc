// GroupRegistry with real GlooCommunicators: several "sidecars" (one registry
// and store each) in one process, rank > 0 reaching rank 0's store directly.
#include "server/collective/group_registry.h"

#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/backend/gloo_communicator.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::collective {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

// A client of another sidecar's store (what the gRPC client does in qtxd).
class ForwardingClient final : public backend::RendezvousClient {
 public:
  explicit ForwardingClient(KvStore* s) : s_(s) {}
  absl::Status Set(std::string_view k, std::string_view v, absl::Time d) override {
    return s_->Set(k, v, d);
  }
  absl::StatusOr<std::vector<std::string>> Get(std::span<const std::string> k,
                                               absl::Time d) override {
    return s_->Get(k, d);
  }

 private:
  KvStore* s_;
};

// One simulated sidecar. The coordinator address "sidecar:<i>" names sidecar i.
struct Sidecar {
  explicit Sidecar(std::vector<std::unique_ptr<Sidecar>>* all) {
    GroupRegistryOptions o;
    o.local_store = &store;
    o.connect = [all](const std::string& coordinator)
        -> absl::StatusOr<std::unique_ptr<backend::RendezvousClient>> {
      const size_t i = std::stoul(coordinator.substr(coordinator.find(':') + 1));
      if (i >= all->size()) return absl::UnavailableError("no such sidecar " + coordinator);
      return std::make_unique<ForwardingClient>(&(*all)[i]->store);
    };
    o.make_communicator =
        [](const GroupSpec& spec, backend::RendezvousClient& store, const std::string& prefix,
           absl::Time deadline) -> absl::StatusOr<std::unique_ptr<backend::Communicator>> {
      backend::GlooCommunicatorOptions g;
      g.group = spec.name;
      g.rank = spec.rank;
      g.world_size = spec.world_size;
      g.key_prefix = prefix;
      g.store = &store;
      g.deadline = deadline;
      auto c = backend::GlooCommunicator::Create(g);
      if (!c.ok()) return c.status();
      return std::unique_ptr<backend::Communicator>(std::move(*c));
    };
    registry = std::make_unique<GroupRegistry>(std::move(o));
  }
  KvStore store;
  std::unique_ptr<GroupRegistry> registry;
};

class GroupRegistryTest : public ::testing::Test {
 protected:
  void MakeSidecars(int n) {
    for (int i = 0; i < n; ++i) sidecars_.push_back(std::make_unique<Sidecar>(&sidecars_));
  }
  GroupRegistry& reg(int i) { return *sidecars_[i]->registry; }

  GroupSpec Spec(const std::string& name, int rank, int world, absl::Duration timeout) {
    GroupSpec s;
    s.name = name;
    s.rank = rank;
    s.world_size = world;
    s.coordinator = rank == 0 ? "" : "sidecar:0";
    s.timeout = timeout;
    return s;
  }

  // Creates `name` on sidecars [0, joining) with world size `world`; returns
  // each rank's result.
  std::vector<absl::StatusOr<GroupInfo>> Create(const std::string& name, int world, int joining,
                                                absl::Duration timeout = absl::Seconds(10)) {
    std::vector<absl::StatusOr<GroupInfo>> out(joining, absl::UnknownError("not done"));
    std::vector<absl::Notification> done(joining);
    for (int r = 0; r < joining; ++r) {
      reg(r).CreateGroup(Spec(name, r, world, timeout), [&, r](absl::StatusOr<GroupInfo> i) {
        out[r] = std::move(i);
        done[r].Notify();
      });
    }
    for (auto& d : done) d.WaitForNotification();
    return out;
  }

  // Runs one collective on every listed rank: an AllGatherV of `rank+1`
  // bytes of value `rank`, checked on return.
  std::vector<absl::Status> Gather(const std::string& name, std::vector<int> ranks,
                                   uint64_t sequence, absl::Duration deadline, int world = -1) {
    if (world < 0) world = static_cast<int>(ranks.size());
    std::vector<absl::Status> out(ranks.size());
    std::vector<absl::Notification> done(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) {
      Collective c;
      c.sequence = sequence;
      c.deadline = absl::Now() + deadline;
      const int r = ranks[i];
      c.run = [r, world, d = c.deadline](backend::Communicator& comm) {
        std::vector<uint64_t> sizes(world);
        std::iota(sizes.begin(), sizes.end(), 1);
        std::vector<uint8_t> send(r + 1, static_cast<uint8_t>(r));
        std::vector<uint8_t> recv(world * (world + 1) / 2, 0xFF);
        absl::Status s = comm.AllGatherV(send.data(), sizes, recv.data(), {d});
        if (!s.ok()) return CollectiveOutcome{s, true};
        size_t off = 0;
        for (int q = 0; q < world; ++q) {
          for (int j = 0; j <= q; ++j) {
            if (recv[off++] != q) return CollectiveOutcome{absl::DataLossError("bad bytes"), false};
          }
        }
        return CollectiveOutcome{absl::OkStatus(), false};
      };
      c.finish = [&, i](absl::Status s) {
        out[i] = s;
        done[i].Notify();
      };
      reg(r).Submit(name, std::move(c));
    }
    for (auto& d : done) d.WaitForNotification();
    return out;
  }

  std::vector<std::unique_ptr<Sidecar>> sidecars_;
};

TEST_F(GroupRegistryTest, CreatesGroupsAndRunsCollectivesInOrder) {
  MakeSidecars(3);
  auto created = Create("tp", 3, 3);
  for (auto& c : created) {
    QTX_ASSERT_OK(c);
    EXPECT_EQ(c->state, GroupState::kReady);
  }
  for (uint64_t seq = 0; seq < 3; ++seq) {
    for (const auto& s : Gather("tp", {0, 1, 2}, seq, absl::Seconds(10))) QTX_EXPECT_OK(s);
  }
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, reg(1).GetGroup("tp"));
  EXPECT_EQ(info.next_sequence, 3u);
  EXPECT_EQ(info.rank, 1);
  ASSERT_EQ(reg(2).ListGroups().size(), 1u);
}

TEST_F(GroupRegistryTest, CallsAheadOfTheirTurnWaitForPredecessors) {
  MakeSidecars(2);
  for (auto& c : Create("g", 2, 2)) QTX_ASSERT_OK(c);
  // Queue sequence 1 first on both ranks, then 0: both must run, in order.
  std::vector<absl::Status> late(2);
  std::thread t([&] { late = Gather("g", {0, 1}, 1, absl::Seconds(10)); });
  absl::SleepFor(absl::Milliseconds(100));
  for (const auto& s : Gather("g", {0, 1}, 0, absl::Seconds(10))) QTX_EXPECT_OK(s);
  t.join();
  for (const auto& s : late) QTX_EXPECT_OK(s);
}

TEST_F(GroupRegistryTest, WrongSequenceIsFailedPreconditionNamingTheExpectedOne) {
  MakeSidecars(2);
  for (auto& c : Create("g", 2, 2)) QTX_ASSERT_OK(c);
  for (const auto& s : Gather("g", {0, 1}, 0, absl::Seconds(10))) QTX_ASSERT_OK(s);
  absl::Status s;
  Collective c;
  c.sequence = 0;
  c.run = [](backend::Communicator&) { return CollectiveOutcome{}; };
  c.finish = [&](absl::Status st) { s = st; };
  reg(0).Submit("g", std::move(c));
  EXPECT_THAT(
      s, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("expects sequence 1 next")));
  Collective far;
  far.sequence = 1000;
  far.run = [](backend::Communicator&) { return CollectiveOutcome{}; };
  far.finish = [&](absl::Status st) { s = st; };
  reg(0).Submit("g", std::move(far));
  EXPECT_THAT(
      s, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("expects sequence 1 next")));
  // The group is still fine.
  for (const auto& st : Gather("g", {0, 1}, 1, absl::Seconds(10))) QTX_EXPECT_OK(st);
}

TEST_F(GroupRegistryTest, ValidationAndDuplicates) {
  MakeSidecars(1);
  absl::Status s;
  auto capture = [&](absl::StatusOr<GroupInfo> r) { s = r.status(); };
  reg(0).CreateGroup(Spec("", 0, 1, absl::Seconds(1)), capture);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name")));
  reg(0).CreateGroup(Spec("bad/name", 0, 1, absl::Seconds(1)), capture);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name='bad/name'")));
  reg(0).CreateGroup(Spec("g", 0, 0, absl::Seconds(1)), capture);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size=0")));
  reg(0).CreateGroup(Spec("g", 2, 2, absl::Seconds(1)), capture);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank=2")));
  GroupSpec no_coord = Spec("g", 1, 2, absl::Seconds(1));
  no_coord.coordinator.clear();
  reg(0).CreateGroup(no_coord, capture);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("coordinator")));
  reg(0).CreateGroup(Spec("g", 0, 1, absl::ZeroDuration()), capture);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));

  for (auto& c : Create("solo", 1, 1)) QTX_ASSERT_OK(c);
  reg(0).CreateGroup(Spec("solo", 0, 1, absl::Seconds(1)), capture);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("'solo' already exists")));
  EXPECT_THAT(reg(0).DestroyGroup("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  Collective c;
  c.finish = [&](absl::Status st) { s = st; };
  reg(0).Submit("nope", std::move(c));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, HasSubstr("CreateGroup")));
}

TEST_F(GroupRegistryTest, MissingRankFailsJoinNamingIt) {
  MakeSidecars(3);
  const absl::Time start = absl::Now();
  auto created = Create("g", 3, 2, absl::Milliseconds(500));  // rank 2 never comes
  const absl::Duration took = absl::Now() - start;
  for (auto& c : created) {
    EXPECT_THAT(c, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank(s) [2] of")));
  }
  EXPECT_LT(took, absl::Seconds(3));
  // The failed group is gone everywhere, its keys too, and the name is free.
  EXPECT_TRUE(reg(0).ListGroups().empty());
  EXPECT_TRUE(reg(1).ListGroups().empty());
  for (auto& c : Create("g", 2, 2)) QTX_EXPECT_OK(c);
  QTX_EXPECT_OK(reg(0).DestroyGroup("g"));
  QTX_EXPECT_OK(reg(1).DestroyGroup("g"));
  EXPECT_EQ(sidecars_[0]->store.num_keys(), 0u);
}

TEST_F(GroupRegistryTest, CoordinatorThatNeverCreatesIsNamed) {
  MakeSidecars(2);
  absl::StatusOr<GroupInfo> r = absl::UnknownError("");
  absl::Notification n;
  reg(1).CreateGroup(Spec("g", 1, 2, absl::Milliseconds(300)), [&](auto i) {
    r = std::move(i);
    n.Notify();
  });
  n.WaitForNotification();
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kDeadlineExceeded,
                          HasSubstr("rank 0 did not create the group")));
}

TEST_F(GroupRegistryTest, MissingPeerBreaksTheGroupOnTimeAndANewGroupWorks) {
  MakeSidecars(3);
  for (auto& c : Create("g", 3, 3)) QTX_ASSERT_OK(c);
  const absl::Time start = absl::Now();
  auto results = Gather("g", {0, 1}, 0, absl::Milliseconds(700), 3);  // rank 2 never calls
  const absl::Duration took = absl::Now() - start;
  for (const auto& s : results) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(s) || absl::IsAborted(s) || absl::IsUnavailable(s)) << s;
  }
  EXPECT_LT(took, absl::Seconds(2)) << took;
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, reg(0).GetGroup("g"));
  EXPECT_EQ(info.state, GroupState::kBroken);
  EXPECT_FALSE(info.error.empty());
  // Later calls are refused at once.
  absl::Status s;
  Collective c;
  c.sequence = 1;
  c.run = [](backend::Communicator&) { return CollectiveOutcome{}; };
  c.finish = [&](absl::Status st) { s = st; };
  reg(0).Submit("g", std::move(c));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, HasSubstr("BROKEN")));
  for (int r = 0; r < 3; ++r) QTX_ASSERT_OK(reg(r).DestroyGroup("g"));
  for (auto& cr : Create("g", 3, 3)) QTX_ASSERT_OK(cr);
  for (const auto& st : Gather("g", {0, 1, 2}, 0, absl::Seconds(10))) QTX_EXPECT_OK(st);
}

TEST_F(GroupRegistryTest, ConcurrentGroupsOnOneSidecar) {
  MakeSidecars(2);
  std::vector<std::string> names = {"a", "b", "c"};
  std::vector<std::thread> threads;
  std::vector<std::vector<absl::StatusOr<GroupInfo>>> created(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    threads.emplace_back([&, i] { created[i] = Create(names[i], 2, 2); });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  for (auto& v : created)
    for (auto& c : v) QTX_ASSERT_OK(c);
  std::vector<std::vector<absl::Status>> results(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    threads.emplace_back([&, i] {
      for (uint64_t seq = 0; seq < 5; ++seq) {
        auto r = Gather(names[i], {0, 1}, seq, absl::Seconds(10));
        results[i].insert(results[i].end(), r.begin(), r.end());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& v : results)
    for (auto& s : v) QTX_EXPECT_OK(s);
  EXPECT_EQ(reg(0).ListGroups().size(), 3u);
  for (const auto& n : names) {
    QTX_EXPECT_OK(reg(0).DestroyGroup(n));
    QTX_EXPECT_OK(reg(1).DestroyGroup(n));
  }
  EXPECT_EQ(sidecars_[0]->store.num_keys(), 0u);
}

// Issue 18 item 2: an absurd world_size is refused at once, before any
// memory is spent on it.
TEST_F(GroupRegistryTest, AbsurdWorldSizeIsRefusedNamingTheMaximum) {
  MakeSidecars(1);
  for (int world : {1025, 1 << 24, 2147483647}) {
    absl::StatusOr<GroupInfo> r = absl::UnknownError("not done");
    absl::Notification n;
    reg(0).CreateGroup(Spec("huge", 0, world, absl::Seconds(1)), [&](auto i) {
      r = std::move(i);
      n.Notify();
    });
    ASSERT_TRUE(n.WaitForNotificationWithTimeout(absl::Seconds(30))) << world;
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kInvalidArgument,
                            HasSubstr(absl::StrCat("world_size=", world, ": at most 1024"))));
  }
  EXPECT_TRUE(reg(0).ListGroups().empty());
  EXPECT_EQ(sidecars_[0]->store.num_keys(), 0u);
}

// Issue 18 item 2: with most ranks missing, the join error names a few of
// them and counts the rest, on rank 0 and on a rank > 0.
TEST_F(GroupRegistryTest, JoinErrorOfALargeGroupNamesAFewRanksAndACount) {
  MakeSidecars(2);
  auto created = Create("big", 1024, 2, absl::Milliseconds(300));
  for (auto& c : created) {
    EXPECT_THAT(c, StatusIs(absl::StatusCode::kDeadlineExceeded,
                            HasSubstr("rank(s) [2, 3, 4, 5, 6 and 1017 more] of world_size 1024")));
    EXPECT_LT(c.status().message().size(), 300u) << c.status().message();
  }
  EXPECT_TRUE(reg(0).ListGroups().empty());
}

// Issue 18 item 2: DestroyGroup ends a join that waits for a missing rank
// (the group would otherwise wait for its whole timeout).
TEST_F(GroupRegistryTest, DestroyGroupEndsAJoinAtOnce) {
  MakeSidecars(2);
  for (int rank : {0, 1}) {
    absl::StatusOr<GroupInfo> r = absl::UnknownError("not done");
    absl::Notification n;
    reg(rank).CreateGroup(Spec("w", rank, 3, absl::Minutes(10)), [&](auto i) {
      r = std::move(i);
      n.Notify();
    });
    // Wait until the group is registered (JOINING), then destroy it.
    while (reg(rank).ListGroups().empty()) absl::SleepFor(absl::Milliseconds(5));
    if (rank == 1) absl::SleepFor(absl::Milliseconds(50));  // let it reach its wait
    QTX_ASSERT_OK(reg(rank).DestroyGroup("w"));
    ASSERT_TRUE(n.WaitForNotificationWithTimeout(absl::Seconds(60))) << "rank " << rank;
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kAborted, HasSubstr("destroyed while joining")))
        << "rank " << rank;
  }
}

// Issue 18 item 12: DestroyGroup ends a collective that waits for a missing
// peer at once (it used to run until its own deadline, 30 s here).
TEST_F(GroupRegistryTest, DestroyGroupAbortsACollectiveWaitingForAPeer) {
  MakeSidecars(3);
  for (auto& c : Create("d", 3, 3)) QTX_ASSERT_OK(c);
  std::vector<absl::Status> results;
  absl::Time start;
  std::thread gather([&] {
    start = absl::Now();
    results = Gather("d", {0, 1}, 0, absl::Seconds(30), 3);  // rank 2 never calls
  });
  absl::SleepFor(absl::Milliseconds(300));  // both calls are waiting for rank 2
  QTX_ASSERT_OK(reg(0).DestroyGroup("d"));
  QTX_ASSERT_OK(reg(1).DestroyGroup("d"));
  gather.join();
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Seconds(5)) << took;
  ASSERT_EQ(results.size(), 2u);
  for (const absl::Status& s : results) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, HasSubstr("aborted"))) << s;
  }
  QTX_ASSERT_OK(reg(2).DestroyGroup("d"));
  // A new incarnation works.
  for (auto& cr : Create("d", 3, 3)) QTX_ASSERT_OK(cr);
  for (const auto& st : Gather("d", {0, 1, 2}, 0, absl::Seconds(10))) QTX_EXPECT_OK(st);
}

// Issue 18 item 3: rank 0's store keeps a group's keys only while the group
// exists: destroying it erases them, and a failed join's keys go too.
TEST_F(GroupRegistryTest, RendezvousKeysAreErasedWithTheGroup) {
  MakeSidecars(2);
  for (auto& c : Create("k", 2, 2)) QTX_ASSERT_OK(c);
  EXPECT_GT(sidecars_[0]->store.num_keys(), 0u);
  QTX_ASSERT_OK(reg(0).DestroyGroup("k"));
  QTX_ASSERT_OK(reg(1).DestroyGroup("k"));
  EXPECT_EQ(sidecars_[0]->store.num_keys(), 0u);
  EXPECT_EQ(sidecars_[0]->store.num_bytes(), 0u);
  EXPECT_EQ(sidecars_[0]->store.num_namespaces(), 0u);
  // A group that fails to form is closed at once (no more keys) and erased
  // by the store a little later.
  auto failed = Create("f", 3, 1, absl::Milliseconds(100));
  EXPECT_THAT(failed[0], StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("did not join")));
  EXPECT_THAT(sidecars_[0]->store.Put("qtx/group/f/x", "1"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("closed")));
}

// Issue 18 item 14: a rank that destroys and re-creates a group whose rank 0
// still runs the old incarnation waits for a new incarnation, and fails at
// its own timeout, not by joining the old one.
TEST_F(GroupRegistryTest, RecreatedRankWaitsForTheNewIncarnation) {
  MakeSidecars(2);
  for (auto& c : Create("re", 2, 2)) QTX_ASSERT_OK(c);
  QTX_ASSERT_OK(reg(1).DestroyGroup("re"));
  absl::StatusOr<GroupInfo> r = absl::UnknownError("not done");
  absl::Notification n;
  reg(1).CreateGroup(Spec("re", 1, 2, absl::Milliseconds(300)), [&](auto i) {
    r = std::move(i);
    n.Notify();
  });
  n.WaitForNotification();
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kDeadlineExceeded,
                          HasSubstr("rank 0 did not create the group")));
  // Once rank 0 re-creates it too, both join the new incarnation.
  QTX_ASSERT_OK(reg(0).DestroyGroup("re"));
  for (auto& c : Create("re", 2, 2)) QTX_ASSERT_OK(c);
  for (const auto& st : Gather("re", {0, 1}, 0, absl::Seconds(10))) QTX_EXPECT_OK(st);
}

}  // namespace
}  // namespace qtx::server::collective

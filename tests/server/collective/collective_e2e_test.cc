// Several qtxd processes on loopback, driven through generated stubs: one
// thread per rank calls its own sidecar. Bit identity of AllGather with
// QuantizeBlock(concat(shards)), and the fault cases.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "qtx/v1/collective.grpc.pb.h"
#include "tests/server/collective/allgather_e2e_support.h"
#include "tests/testing/qtxd_process.h"

#ifndef QTXD_PATH
#error "QTXD_PATH must name the qtxd binary"
#endif

namespace qtx {
namespace {

using ::qtx::testing::Bytes;
using ::qtx::testing::MakeShards;
using ::qtx::testing::QtxdProcess;
using ::qtx::testing::Request;
using ::qtx::testing::RunAllGather;
using ::qtx::testing::Shards;
using ::testing::HasSubstr;

// How late past its deadline a call that waits on a missing peer may return:
// far below the groups' 20 s timeout (what a call that ignored its deadline
// would wait for), far above what a loaded 2-core CI machine needs to run
// the callers' threads after the deadline.
constexpr absl::Duration kDeadlineSlack = absl::Seconds(5);

struct Sidecar {
  std::unique_ptr<QtxdProcess> process;  // null if it did not start
  int port = 0;
  std::unique_ptr<v1::Collective::Stub> stub;
  std::shared_ptr<grpc::Channel> channel;
};

// `n` qtxd (QtxdProcess), each on its unix socket and a loopback TCP port (the
// coordinator's address for the other ranks).
class Cluster {
 public:
  explicit Cluster(int n) {
    for (int i = 0; i < n; ++i) {
      Sidecar s;
      QtxdProcess::Options options;
      options.timeout = absl::Seconds(20);
      absl::StatusOr<std::unique_ptr<QtxdProcess>> process =
          QtxdProcess::StartOnLoopbackPort(QTXD_PATH, {"--threads=2"}, options, &s.port);
      // A rank that did not start fails the test; its calls fail (UNAVAILABLE).
      EXPECT_TRUE(process.ok()) << "qtxd " << i << " did not start: " << process.status();
      std::string target = "unix:/nonexistent/qtxd.sock";
      if (process.ok()) {
        s.process = *std::move(process);
        target = s.process->target();
      }
      s.channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
      s.stub = v1::Collective::NewStub(s.channel);
      sidecars.push_back(std::move(s));
    }
  }
  // kill -9 of every rank (no clean shutdown to wait for).
  ~Cluster() {
    for (auto& s : sidecars) Kill(s);
  }
  void Kill(int i) { Kill(sidecars[i]); }
  bool Alive(int i) const {
    return sidecars[i].process != nullptr && sidecars[i].process->pid() >= 0;
  }
  std::string Coordinator() const { return absl::StrCat("127.0.0.1:", sidecars[0].port); }
  bool Healthy(int i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ListGroupsRequest req;
    v1::ListGroupsResponse resp;
    return sidecars[i].stub->ListGroups(&ctx, req, &resp).ok();
  }

  // CreateGroup on ranks [0, world) concurrently.
  std::vector<grpc::Status> Create(const std::string& name, int world, uint32_t timeout_ms,
                                   int skip_rank = -1) {
    std::vector<grpc::Status> out(world);
    std::vector<std::thread> t;
    for (int r = 0; r < world; ++r) {
      if (r == skip_rank) continue;
      t.emplace_back([&, r] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        v1::CreateGroupRequest req;
        req.set_name(name);
        req.set_rank(r);
        req.set_world_size(world);
        req.set_coordinator(r == 0 ? "" : Coordinator());
        req.set_timeout_ms(timeout_ms);
        v1::CreateGroupResponse resp;
        out[r] = sidecars[r].stub->CreateGroup(&ctx, req, &resp);
      });
    }
    for (auto& th : t) th.join();
    return out;
  }

  std::vector<grpc::Status> Destroy(const std::string& name, int world) {
    std::vector<grpc::Status> out(world);
    for (int r = 0; r < world; ++r) {
      if (!Alive(r)) continue;
      grpc::ClientContext ctx;
      v1::DestroyGroupRequest req;
      req.set_name(name);
      v1::DestroyGroupResponse resp;
      out[r] = sidecars[r].stub->DestroyGroup(&ctx, req, &resp);
    }
    return out;
  }

  std::vector<Sidecar> sidecars;

 private:
  static void Kill(Sidecar& s) {
    if (s.process != nullptr) s.process->Kill();
  }
};

class CollectiveE2E : public ::testing::TestWithParam<int> {};

TEST_P(CollectiveE2E, AllGatherIsBitIdenticalToQuantizeOfConcatenation) {
  const int world = GetParam();
  std::vector<std::vector<int64_t>> grids;
  if (world == 2) grids = {{64, 64}, {0, 300}, {128, 128}};
  if (world == 3) grids = {{100, 156, 1}, {129, 127, 256}};
  if (world == 4) grids = {{250, 250, 250, 250}, {1, 1, 1, 1}};
  Cluster c(world);
  for (const auto& s : c.Create("e2e", world, 20000)) ASSERT_TRUE(s.ok()) << s.error_message();
  uint64_t seq = 0;
  for (const auto& rows : grids) {
    for (int64_t n : {1, 100, 128, 300}) {
      const Shards sh = MakeShards(rows, n);
      for (auto scaling : {v1::BLOCK_1D, v1::BLOCK_2D, v1::TENSOR}) {
        const auto ks = scaling == v1::BLOCK_1D   ? kernels::BlockScaling::kBlock1D
                        : scaling == v1::BLOCK_2D ? kernels::BlockScaling::kBlock2D
                                                  : kernels::BlockScaling::kTensor;
        const kernels::QuantizeParams p{ks, kernels::Fp8Format::kE4M3, true, true, true, 0.0f};
        const auto l = kernels::ComputeLayout(ks, sh.m, n);
        std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
        std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
        kernels::cpu::QuantizeBlock(sh.x.data(), kernels::InputDType::kBFloat16, sh.m, n, p,
                                    {rd.data(), rs.data(), cd.data(), cs.data()});
        for (auto mode : {v1::EXACT_FP8, v1::GATHER_HIGH_PRECISION}) {
          SCOPED_TRACE(absl::StrFormat("world=%d m=%d n=%d scaling=%d mode=%d", world, sh.m, n,
                                       scaling, mode));
          std::vector<v1::AllGatherRequest> reqs;
          for (int r = 0; r < world; ++r) reqs.push_back(Request("e2e", seq, sh, r, mode, scaling));
          ++seq;
          std::vector<v1::AllGatherResponse> resps;
          auto st = RunAllGather(c, reqs, &resps, absl::Seconds(30));
          for (int r = 0; r < world; ++r) {
            ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
            const auto& q = resps[r].result();
            EXPECT_EQ(q.rowwise_data().inline_data(), Bytes(rd.data(), rd.size()));
            EXPECT_EQ(q.rowwise_scale_inv().inline_data(), Bytes(rs.data(), rs.size() * 4));
            EXPECT_EQ(q.columnwise_data().inline_data(), Bytes(cd.data(), cd.size()));
            EXPECT_EQ(q.columnwise_scale_inv().inline_data(), Bytes(cs.data(), cs.size() * 4));
            EXPECT_THAT(resps[r].shard_rows(), ::testing::ElementsAreArray(rows));
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectiveE2E, ::testing::Values(2, 3, 4));

// One round (AllGatherRequest.shard_rows): qtxd processes on loopback, every
// shard pattern of the suite above plus shards smaller than a block in the
// middle of the group; 1-D, 2-D and TENSOR; rowwise, columnwise and both. Every rank's
// bytes equal QuantizeBlock of the concatenation (and so the header path's,
// which the suite above holds to the same reference; the op test compares
// the two paths directly).
class OneRoundE2E : public ::testing::TestWithParam<int> {};

TEST_P(OneRoundE2E, AllGatherWithShardRowsIsBitIdentical) {
  const int world = GetParam();
  std::vector<std::vector<int64_t>> grids;
  if (world == 2) grids = {{64, 64}, {0, 300}, {128, 128}, {5, 300}};
  if (world == 3) grids = {{100, 156, 1}, {129, 127, 256}, {200, 3, 300}};
  if (world == 4) grids = {{250, 250, 250, 250}, {1, 1, 1, 1}, {128, 5, 123, 128}};
  if (world == 5) grids = {{250, 1, 2, 5, 300}, {128, 5, 123, 0, 128}, {300, 100, 3, 0, 129}};
  Cluster c(world);
  for (const auto& s : c.Create("one", world, 20000)) ASSERT_TRUE(s.ok()) << s.error_message();
  const struct { bool row, col; } copies[] = {{true, false}, {false, true}, {true, true}};
  uint64_t seq = 0;
  for (const auto& rows : grids) {
    for (int64_t n : {100, 300}) {
      const Shards sh = MakeShards(rows, n);
      for (auto scaling : {v1::BLOCK_1D, v1::BLOCK_2D, v1::TENSOR}) {
        const auto ks = scaling == v1::BLOCK_1D   ? kernels::BlockScaling::kBlock1D
                        : scaling == v1::BLOCK_2D ? kernels::BlockScaling::kBlock2D
                                                  : kernels::BlockScaling::kTensor;
        for (const auto& cp : copies) {
          const kernels::QuantizeParams p{ks,  kernels::Fp8Format::kE4M3, cp.row, cp.col, true,
                                          0.0f};
          const auto l = kernels::ComputeLayout(ks, sh.m, n);
          std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
          std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
          kernels::cpu::QuantizeBlock(sh.x.data(), kernels::InputDType::kBFloat16, sh.m, n, p,
                                      {rd.data(), rs.data(), cd.data(), cs.data()});
          for (auto mode : {v1::EXACT_FP8, v1::GATHER_HIGH_PRECISION}) {
            if (mode == v1::GATHER_HIGH_PRECISION && !(cp.row && cp.col)) continue;
            SCOPED_TRACE(absl::StrFormat("world=%d m=%d n=%d scaling=%d row=%d col=%d mode=%d",
                                         world, sh.m, n, scaling, cp.row, cp.col, mode));
            std::vector<v1::AllGatherRequest> reqs;
            for (int r = 0; r < world; ++r) {
              reqs.push_back(Request("one", seq, sh, r, mode, scaling));
              reqs.back().mutable_config()->set_rowwise(cp.row);
              reqs.back().mutable_config()->set_columnwise(cp.col);
              for (int64_t m : rows) reqs.back().add_shard_rows(m);
            }
            ++seq;
            std::vector<v1::AllGatherResponse> resps;
            auto st = RunAllGather(c, reqs, &resps, absl::Seconds(30));
            for (int r = 0; r < world; ++r) {
              ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
              const auto& q = resps[r].result();
              if (cp.row) {
                EXPECT_EQ(q.rowwise_data().inline_data(), Bytes(rd.data(), rd.size()));
                EXPECT_EQ(q.rowwise_scale_inv().inline_data(), Bytes(rs.data(), rs.size() * 4));
              }
              if (cp.col) {
                EXPECT_EQ(q.columnwise_data().inline_data(), Bytes(cd.data(), cd.size()));
                EXPECT_EQ(q.columnwise_scale_inv().inline_data(), Bytes(cs.data(), cs.size() * 4));
              }
              EXPECT_THAT(resps[r].shard_rows(), ::testing::ElementsAreArray(rows));
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, OneRoundE2E, ::testing::Values(2, 3, 4, 5));

// Disagreeing shard_rows and digests across processes fail every rank with
// a message naming the field and the rank; a rank that dies during a
// one-round call fails the others within the deadline.
TEST(OneRoundFaults, MismatchedShardRowsDigestsAndAKilledRank) {
  Cluster c(3);
  for (const auto& s : c.Create("of", 3, 20000)) ASSERT_TRUE(s.ok()) << s.error_message();
  const std::vector<int64_t> rows = {256, 28, 100};
  const Shards a = MakeShards(rows, 128);
  auto requests = [&](uint64_t seq) {
    std::vector<v1::AllGatherRequest> reqs;
    for (int r = 0; r < 3; ++r) {
      reqs.push_back(Request("of", seq, a, r, v1::EXACT_FP8, v1::BLOCK_1D));
      for (int64_t m : rows) reqs.back().add_shard_rows(m);
    }
    return reqs;
  };
  {
    // Rank 2 passes another list (its own entry right, the payload size the
    // same): the digest differs.
    auto reqs = requests(0);
    reqs[2].set_shard_rows(1, 27);
    std::vector<v1::AllGatherResponse> resps;
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(20));
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(st[r].error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st[r].error_message();
      EXPECT_THAT(st[r].error_message(),
                  HasSubstr("ranks disagree on shard_rows: rank 0 and rank 2 passed different"));
      EXPECT_FALSE(resps[r].has_result()) << "rank " << r << " returned an output";
    }
  }
  {
    // A config field that does not change the payload size.
    auto reqs = requests(1);
    reqs[1].mutable_config()->set_format(v1::E5M2);
    std::vector<v1::AllGatherResponse> resps;
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(20));
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(st[r].error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st[r].error_message();
      EXPECT_THAT(st[r].error_message(), HasSubstr("ranks disagree on config.format: rank 0 has"));
    }
  }
  {
    // shard_rows that contradict a rank's input: that rank says so, the
    // others name it.
    auto reqs = requests(2);
    for (auto& q : reqs) q.set_shard_rows(2, 99);
    std::vector<v1::AllGatherResponse> resps;
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(20));
    EXPECT_THAT(st[2].error_message(), HasSubstr("shard_rows[2]=99 but this rank's input has 100"));
    for (int r : {0, 1}) {
      EXPECT_EQ(st[r].error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(st[r].error_message(), HasSubstr("rank 2 rejected its request"));
    }
  }
  {
    // The group still works in one round.
    std::vector<v1::AllGatherResponse> resps;
    for (const auto& s : RunAllGather(c, requests(3), &resps, absl::Seconds(20)))
      EXPECT_TRUE(s.ok()) << s.error_message();
  }
  {
    // Rank 2 dies while the others wait in the one-round gather.
    auto reqs = requests(4);
    std::vector<v1::AllGatherResponse> resps;
    std::thread killer([&] {
      absl::SleepFor(absl::Milliseconds(500));
      c.Kill(2);
    });
    const absl::Time start = absl::Now();
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(4), /*skip_rank=*/2);
    killer.join();
    EXPECT_LT(absl::Now() - start, absl::Seconds(4) + kDeadlineSlack);
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(st[r].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                  st[r].error_code() == grpc::StatusCode::ABORTED)
          << st[r].error_code() << " " << st[r].error_message();
      EXPECT_FALSE(resps[r].has_result());
      EXPECT_TRUE(c.Healthy(r));
    }
  }
}

TEST(CollectiveFaults, MissingRankMismatchedNAndKilledSidecar) {
  Cluster c(3);
  for (const auto& s : c.Create("f", 3, 20000)) ASSERT_TRUE(s.ok()) << s.error_message();
  // Mismatched N: every rank fails with INVALID_ARGUMENT naming N and the rank.
  {
    const Shards a = MakeShards({64, 64, 64}, 128), b = MakeShards({64, 64, 64}, 100);
    std::vector<v1::AllGatherRequest> reqs = {Request("f", 0, a, 0, v1::EXACT_FP8, v1::BLOCK_1D),
                                              Request("f", 0, a, 1, v1::EXACT_FP8, v1::BLOCK_1D),
                                              Request("f", 0, b, 2, v1::EXACT_FP8, v1::BLOCK_1D)};
    std::vector<v1::AllGatherResponse> resps;
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(20));
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(st[r].error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st[r].error_message();
      EXPECT_THAT(st[r].error_message(),
                  HasSubstr("disagree on n: rank 0 has 128, rank 2 has 100"));
    }
  }
  // Interprocess CUDA events need a CUDA device: refused on the CPU rank that
  // sent them, and every other rank fails too, naming that rank.
  {
    const Shards a = MakeShards({64, 64, 64}, 128);
    std::vector<v1::AllGatherRequest> reqs;
    for (int r = 0; r < 3; ++r) reqs.push_back(Request("f", 1, a, r, v1::EXACT_FP8, v1::BLOCK_1D));
    reqs[1].mutable_cuda_events()->set_wait_event(std::string(64, 'e'));
    std::vector<v1::AllGatherResponse> resps;
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(20));
    EXPECT_EQ(st[1].error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st[1].error_message();
    EXPECT_THAT(st[1].error_message(), HasSubstr("cuda_events"));
    EXPECT_THAT(st[1].error_message(), HasSubstr("--device=cuda:N"));
    for (int r : {0, 2}) {
      EXPECT_FALSE(st[r].ok());
      EXPECT_THAT(st[r].error_message(), HasSubstr("rank 1"));
    }
  }
  // One rank never calls: the others fail with DEADLINE_EXCEEDED within the deadline.
  {
    const Shards a = MakeShards({64, 64, 64}, 128);
    std::vector<v1::AllGatherRequest> reqs;
    for (int r = 0; r < 3; ++r) reqs.push_back(Request("f", 2, a, r, v1::EXACT_FP8, v1::BLOCK_1D));
    std::vector<v1::AllGatherResponse> resps;
    const absl::Time start = absl::Now();
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(3), /*skip_rank=*/2);
    EXPECT_LT(absl::Now() - start, absl::Seconds(3) + kDeadlineSlack);
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(st[r].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                  st[r].error_code() == grpc::StatusCode::ABORTED)
          << st[r].error_code() << " " << st[r].error_message();
    }
    for (int r = 0; r < 3; ++r) EXPECT_TRUE(c.Healthy(r));
    c.Destroy("f", 3);
  }
  // A new group works; then a sidecar is killed mid-call.
  for (const auto& s : c.Create("g", 3, 20000)) ASSERT_TRUE(s.ok()) << s.error_message();
  {
    const Shards a = MakeShards({64, 64, 64}, 128);
    std::vector<v1::AllGatherRequest> reqs;
    for (int r = 0; r < 3; ++r) reqs.push_back(Request("g", 0, a, r, v1::EXACT_FP8, v1::BLOCK_1D));
    std::vector<v1::AllGatherResponse> resps;
    std::thread killer([&] {
      absl::SleepFor(absl::Milliseconds(500));
      c.Kill(2);
    });
    const absl::Time start = absl::Now();
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(4), /*skip_rank=*/2);
    killer.join();
    EXPECT_LT(absl::Now() - start, absl::Seconds(4) + kDeadlineSlack);
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(st[r].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                  st[r].error_code() == grpc::StatusCode::ABORTED)
          << st[r].error_code() << " " << st[r].error_message();
      EXPECT_TRUE(c.Healthy(r));
    }
  }
  c.Destroy("g", 2);
  for (const auto& s : c.Create("h", 2, 20000)) EXPECT_TRUE(s.ok()) << s.error_message();
  const Shards a = MakeShards({10, 300}, 128);
  std::vector<v1::AllGatherRequest> reqs;
  for (int r = 0; r < 2; ++r) reqs.push_back(Request("h", 0, a, r, v1::EXACT_FP8, v1::BLOCK_2D));
  std::vector<v1::AllGatherResponse> resps;
  for (const auto& s : RunAllGather(c, reqs, &resps, absl::Seconds(20)))
    EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace qtx

// The AllGather op with real GlooCommunicators, ranks as threads of this
// process: bit identity with QuantizeBlock of the concatenation, and
// agreement / rejection errors reported on every rank.
#include "server/ops/allgather.h"

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "server/backend/cpu_device.h"
#include "server/backend/gloo_communicator.h"
#include "server/collective/kv_store.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::ops {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

class AllGatherOpTest : public ::testing::Test {
 protected:
  void Connect(int world) {
    comms_.clear();
    comms_.resize(world);
    std::vector<std::thread> t;
    for (int r = 0; r < world; ++r) {
      t.emplace_back([&, r, world] {
        backend::GlooCommunicatorOptions o;
        o.group = "op";
        o.rank = r;
        o.world_size = world;
        o.key_prefix = "op" + std::to_string(world) + "/";
        o.store = &store_;
        o.deadline = absl::Now() + absl::Seconds(20);
        auto c = backend::GlooCommunicator::Create(o);
        ASSERT_TRUE(c.ok()) << c.status();
        comms_[r] = std::move(*c);
      });
    }
    for (auto& th : t) th.join();
    ctx_.regions = &regions_;
    ctx_.device = &device_;
  }

  // Runs AllGather on every rank with that rank's spec.
  std::vector<absl::StatusOr<AllGatherResult>> Run(std::vector<AllGatherRequestSpec> specs,
                                                   std::vector<bool>* broken = nullptr) {
    const int w = static_cast<int>(specs.size());
    std::vector<absl::StatusOr<AllGatherResult>> out(w, absl::UnknownError(""));
    std::vector<bool> br(w);
    std::vector<std::thread> t;
    for (int r = 0; r < w; ++r) {
      t.emplace_back([&, r] {
        bool b = false;
        out[r] = AllGather(specs[r], ctx_, *comms_[r], {absl::Now() + absl::Seconds(20)}, &b);
        br[r] = b;
      });
    }
    for (auto& th : t) th.join();
    if (broken) *broken = br;
    return out;
  }

  collective::KvStore store_;
  std::vector<std::unique_ptr<backend::GlooCommunicator>> comms_;
  tensor::RegionTable regions_{tensor::RegionTableOptions{}};
  backend::CpuDevice device_;
  OpContext ctx_;
  uint64_t seq_ = 0;
};

TEST_F(AllGatherOpTest, BitIdenticalToQuantizeOfConcatenation) {
  const std::vector<std::vector<int64_t>> grids = {{100, 156, 1}, {0, 300, 0}, {129, 127, 256}};
  Connect(3);
  for (const auto& shards : grids) {
    for (int64_t n : {1, 128, 300}) {
      int64_t m = 0;
      for (int64_t s : shards) m += s;
      std::vector<uint16_t> x(m * n);
      std::mt19937 rng(static_cast<uint32_t>(m * 7 + n));
      std::normal_distribution<float> d(0, 1);
      int64_t row = 0;
      for (size_t r = 0; r < shards.size(); ++r) {
        const float mag = std::ldexp(1.0f, static_cast<int>(r) * 5 - 4);
        for (int64_t i = 0; i < shards[r] * n; ++i)
          x[row * n + i] = kernels::FloatToBf16(d(rng) * mag);
        row += shards[r];
      }
      for (auto scaling : {kernels::BlockScaling::kBlock1D, kernels::BlockScaling::kBlock2D}) {
        for (auto mode : {AllGatherMode::kExactFp8, AllGatherMode::kGatherHighPrecision}) {
          SCOPED_TRACE(absl::StrFormat("m=%d n=%d %s %s", m, n, ScalingName(scaling),
                                       AllGatherModeName(mode)));
          kernels::QuantizeParams p{scaling, kernels::Fp8Format::kE4M3, true, true, true, 0.0f};
          const auto l = kernels::ComputeLayout(scaling, m, n);
          std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
          std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
          kernels::cpu::QuantizeBlock(x.data(), kernels::InputDType::kBFloat16, m, n, p,
                                      {rd.data(), rs.data(), cd.data(), cs.data()});
          std::vector<AllGatherRequestSpec> specs(3);
          row = 0;
          for (int r = 0; r < 3; ++r) {
            specs[r].group = "op";
            specs[r].sequence = seq_;
            specs[r].mode = mode;
            specs[r].params = p;
            specs[r].input.dtype = tensor::DType::kBFloat16;
            specs[r].input.shape = {shards[r], n};
            specs[r].input.data = std::string_view(
                reinterpret_cast<const char*>(x.data() + row * n), shards[r] * n * 2);
            row += shards[r];
          }
          ++seq_;
          auto res = Run(specs);
          for (int r = 0; r < 3; ++r) {
            ASSERT_TRUE(res[r].ok()) << res[r].status();
            const QuantizeResult& q = res[r]->result;
            EXPECT_EQ(q.shape, (std::vector<int64_t>{m, n}));
            EXPECT_EQ(res[r]->shard_rows, shards);
            EXPECT_EQ(q.rowwise_data->inline_data,
                      std::string(reinterpret_cast<const char*>(rd.data()), rd.size()));
            EXPECT_EQ(q.rowwise_scale_inv->inline_data,
                      std::string(reinterpret_cast<const char*>(rs.data()), rs.size() * 4));
            EXPECT_EQ(q.columnwise_data->inline_data,
                      std::string(reinterpret_cast<const char*>(cd.data()), cd.size()));
            EXPECT_EQ(q.columnwise_scale_inv->inline_data,
                      std::string(reinterpret_cast<const char*>(cs.data()), cs.size() * 4));
          }
        }
      }
    }
  }
}

AllGatherRequestSpec Simple(uint64_t seq, int64_t m, int64_t n, const std::vector<uint16_t>& buf) {
  AllGatherRequestSpec s;
  s.group = "op";
  s.sequence = seq;
  s.input.dtype = tensor::DType::kBFloat16;
  s.input.shape = {m, n};
  s.input.data = std::string_view(reinterpret_cast<const char*>(buf.data()), m * n * 2);
  return s;
}

TEST_F(AllGatherOpTest, DisagreementFailsEveryRankNamingFieldAndRank) {
  Connect(3);
  std::vector<uint16_t> a(64 * 128), b(64 * 100);
  std::vector<bool> broken;
  auto res = Run({Simple(0, 64, 128, a), Simple(0, 64, 128, a), Simple(0, 64, 100, b)}, &broken);
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(res[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("ranks disagree on n: rank 0 has 128, rank 2 has 100")));
    EXPECT_FALSE(broken[r]);
  }
  auto modes = std::vector<AllGatherRequestSpec>{Simple(1, 64, 128, a), Simple(1, 64, 128, a),
                                                 Simple(1, 64, 128, a)};
  modes[1].mode = AllGatherMode::kGatherHighPrecision;
  res = Run(modes);
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(res[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("disagree on mode: rank 0 has EXACT_FP8, rank 1")));
  }
  // A rank whose own request is bad fails everyone, naming it; then all is fine.
  auto bad = std::vector<AllGatherRequestSpec>{Simple(2, 64, 128, a), Simple(2, 64, 128, a),
                                               Simple(2, 64, 128, a)};
  bad[1].input.shape = {65, 128};
  res = Run(bad);
  EXPECT_THAT(res[1], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input")));
  EXPECT_THAT(res[0], StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("rank 1 rejected its request")));
  EXPECT_THAT(res[2], StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("rank 1 rejected its request")));
  res = Run({Simple(3, 64, 128, a), Simple(3, 0, 128, a), Simple(3, 64, 128, a)});
  for (auto& r : res) QTX_EXPECT_OK(r);
}

TEST_F(AllGatherOpTest, PerTensorScalingIsRejectedOnEveryRank) {
  Connect(2);
  std::vector<uint16_t> a(64 * 128);
  auto specs = std::vector<AllGatherRequestSpec>{Simple(0, 64, 128, a), Simple(0, 64, 128, a)};
  for (auto& s : specs) s.params.scaling = kernels::BlockScaling::kTensor;
  auto res = Run(specs);
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(res[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("config.scaling_mode=TENSOR")));
  }
}

TEST_F(AllGatherOpTest, OutputProblemOnOneRankFailsAllRanks) {
  Connect(2);
  std::vector<uint16_t> a(64 * 128);
  auto specs = std::vector<AllGatherRequestSpec>{Simple(0, 64, 128, a), Simple(0, 64, 128, a)};
  specs[1].outputs.rowwise_data = tensor::RegionSliceSpec{"no_such_region", 0, 128 * 128};
  auto res = Run(specs);
  EXPECT_THAT(res[1], StatusIs(absl::StatusCode::kNotFound, HasSubstr("no_such_region")));
  EXPECT_THAT(res[0],
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank 1 could not take part")));
}

}  // namespace
}  // namespace qtx::server::ops

// End-to-end: the FP8 parameter all-gather (Collective.AllGatherParameter,
// docs/numerics.md §10) over 2 and 3 qtxd processes (--device=cpu) forming a
// Gloo Collective group.
//  * Shards from a data-parallel sharded Optimizer.Step, at offsets that cut
//    128x128 tiles (mid-row, mid-tile, a shard smaller than a tile, empty
//    shards, ranges out of rank order), gathered on every rank: the result
//    must equal the rowwise copy the unsharded group's Step returns for the
//    whole parameter, byte for byte (data and scale_inv).
//  * Shards cut directly from the CPU reference's QuantizeBlock of a whole
//    tensor (E4M3 and E5M2, with and without power-of-two scales): inline,
//    and in place in shared-memory regions (each rank's shard already at its
//    offset of the output slice).
//  * Disagreements (scales, ranges, shape, config) and a bad request fail
//    every rank naming the rank and the field, with no result; the group
//    stays usable. A rank that dies fails the others, never a hang.
// Every comparison is against bytes computed without the gather, so a gather
// that put a rank's bytes at another rank's place fails them.
#include <signal.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_ranks.h"
#include "tests/testing/sharded_params.h"
#include "tests/testing/status_matchers.h"

namespace qtx::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

std::string g_qtxd_path;  // from --qtxd=

constexpr absl::Duration kGroupTimeout = absl::Seconds(20);

struct Ranks : QtxdRanks {
  uint64_t sequence = 0;  // the group's next call
};

void StartRanks(int world, Ranks* ranks, absl::Duration group_timeout = kGroupTimeout) {
  QTX_ASSERT_OK(StartQtxdRanks(
      g_qtxd_path, world,
      [](int) {
        return std::vector<std::string>{"--device=cpu", "--threads=2", "--allow_client_shm"};
      },
      ranks));
  const auto infos = CreateGlooGroupOnEveryRank(*ranks, "dp", group_timeout);
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE(infos[r].ok()) << "rank " << r << ": " << infos[r].status();
}

// One AllGatherParameter on every rank with its own shard and range.
std::vector<absl::StatusOr<ParameterAllGatherResult>> GatherOnEveryRank(
    Ranks& ranks, const std::vector<QuantizedTensor>& shards, const std::vector<ShardRange>& range,
    const std::vector<QuantizeOutputs>& outputs = {}) {
  const uint64_t seq = ranks.sequence++;
  std::vector<absl::StatusOr<ParameterAllGatherResult>> out(ranks.world());
  OnEveryRank(ranks.world(), [&](int r) {
    out[r] = ranks.clients[r]->AllGatherParameter("dp", seq, shards[r], range[r],
                                                  outputs.empty() ? QuantizeOutputs{} : outputs[r],
                                                  Deadline(kGroupTimeout), "w");
  });
  return out;
}

// ---- Shards from a sharded Step --------------------------------------------------------------

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<ShardRange> ranges;  // rank r's
  int64_t total() const { return shape[0] * shape[1]; }
};

OptimizerGroupConfig GroupConfig(const std::string& name) {
  OptimizerGroupConfig c;
  c.group = name;
  c.hyper_params.lr = 1e-2;
  c.hyper_params.weight_decay = 0.1;
  return c;  // FP8 128x128, rowwise + columnwise
}

class ParamAllGatherE2eTest : public ::testing::TestWithParam<int> {};

TEST_P(ParamAllGatherE2eTest, ShardsOfAShardedStepGatherToTheWholeParameter) {
  const int world = GetParam();
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  std::vector<Param> params;
  if (world == 2) {
    params = {
        {"w", {300, 260}, {{0, 40000}, {40000, 300 * 260}}},  // cut mid-row, mid-tile
        {"b", {1, 200}, {{77, 200}, {0, 77}}},  // out of rank order; shards smaller than a tile
        {"e", {130, 129}, {{0, 0}, {0, 130 * 129}}},  // rank 0 owns nothing of it
    };
  } else {
    params = {
        // Rank 1's shard: 50 elements inside one tile, ending mid-row.
        {"w",
         {300, 260},
         {{0, 128 * 260 + 77}, {128 * 260 + 77, 128 * 260 + 127}, {128 * 260 + 127, 300 * 260}}},
        {"b", {1, 200}, {{0, 200}, {200, 200}, {0, 0}}},                  // rank 0 owns it all
        {"e", {130, 129}, {{9000, 130 * 129}, {0, 5000}, {5000, 9000}}},  // out of rank order
    };
  }
  std::vector<std::vector<float>> master(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    master[i] = SpreadValues(params[i].total(), 100 + i, 0.1f);
  auto grad = [&](size_t i, int64_t step) {
    return SpreadValues(params[i].total(), static_cast<uint32_t>(1000 * step + i), 1.0f);
  };

  // The reference: the whole parameters, unsharded, on rank 0's sidecar.
  {
    std::vector<OptimizerParameterInit> inits;
    for (size_t i = 0; i < params.size(); ++i) {
      inits.push_back(WholeInit(params[i].name, params[i].shape, master[i]));
    }
    QTX_ASSERT_OK(ranks.clients[0]->OffloadOptimizerState(GroupConfig("ref"), inits).status());
  }
  OnEveryRank(world, [&](int r) {
    std::vector<OptimizerParameterInit> inits;
    for (size_t i = 0; i < params.size(); ++i) {
      inits.push_back(ShardInit(params[i].name, params[i].shape, master[i], params[i].ranges[r]));
    }
    auto info = ranks.clients[r]->OffloadOptimizerState(GroupConfig("opt"), inits);
    ASSERT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
  });

  for (int64_t step = 1; step <= 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    std::vector<OptimizerGradient> whole;
    for (size_t i = 0; i < params.size(); ++i) {
      whole.push_back({params[i].name, Tensor::FromFloat32(params[i].shape, grad(i, step))});
    }
    auto ref = ranks.clients[0]->Step("ref", step, whole);
    ASSERT_TRUE(ref.ok()) << ref.status();

    const uint64_t seq = ranks.sequence++;
    std::vector<absl::StatusOr<OptimizerStepResult>> stepped(world);
    OnEveryRank(world, [&](int r) {
      std::vector<OptimizerGradient> g;
      for (size_t i = 0; i < params.size(); ++i) {
        g.push_back({params[i].name, Slice(grad(i, step), params[i].ranges[r])});
      }
      StepOptions so;
      so.collective_group = "dp";
      so.sequence = seq;
      stepped[r] = ranks.clients[r]->Step("opt", step, g, so, Deadline(kGroupTimeout));
    });
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(stepped[r].ok()) << "rank " << r << ": " << stepped[r].status();
    }

    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      SCOPED_TRACE(absl::StrCat("parameter ", p.name));
      // Each rank passes its Step's FP8 shard as is.
      std::vector<QuantizedTensor> shards;
      for (int r = 0; r < world; ++r) shards.push_back(*stepped[r]->parameters[i].fp8);
      auto out = GatherOnEveryRank(ranks, shards, p.ranges);
      const QuantizedTensor& want = *ref->parameters[i].fp8;
      for (int r = 0; r < world; ++r) {
        SCOPED_TRACE(absl::StrCat("rank ", r));
        ASSERT_TRUE(out[r].ok()) << out[r].status();
        const QuantizedTensor& got = out[r]->tensor;
        EXPECT_EQ(got.shape, p.shape);
        EXPECT_EQ(got.config.scaling_mode, ScalingMode::kBlock2D);
        EXPECT_TRUE(got.config.rowwise);
        EXPECT_FALSE(got.config.columnwise);
        EXPECT_FALSE(got.columnwise_data.has_value());
        EXPECT_FALSE(got.columnwise_scale_inv.has_value());
        ASSERT_TRUE(got.rowwise_data.has_value());
        ASSERT_TRUE(got.rowwise_scale_inv.has_value());
        EXPECT_EQ(got.rowwise_data->shape, (std::vector<int64_t>{p.shape[0], p.shape[1]}));
        EXPECT_EQ(got.rowwise_data->data.size(), static_cast<size_t>(p.total()));
        EXPECT_TRUE(got.rowwise_data->data == want.rowwise_data->data)
            << "gathered FP8 bytes differ from the unsharded Step's";
        EXPECT_EQ(got.rowwise_scale_inv->shape, want.rowwise_scale_inv->shape);
        EXPECT_TRUE(got.rowwise_scale_inv->data == want.rowwise_scale_inv->data);
        EXPECT_EQ(out[r]->ranges, p.ranges);
      }
    }
  }
}

// ---- Shards cut from the reference quantization ----------------------------------------------

QuantizedTensor ShardOf(const QuantizedWhole& w, ShardRange g) {
  QuantizedTensor q;
  q.shape = w.shape;
  q.source_dtype = DType::kFloat32;
  q.config = w.config;
  q.rowwise_data = Tensor::Inline(DataDType(w.config), {g.end - g.begin},
                                  w.data.substr(g.begin, g.end - g.begin));
  q.rowwise_scale_inv = Tensor::Inline(DType::kFloat32, {w.scale_rows, w.scale_cols}, w.scale);
  return q;
}

void ExpectWhole(const std::vector<absl::StatusOr<ParameterAllGatherResult>>& out,
                 const QuantizedWhole& w, const std::vector<ShardRange>& ranges) {
  for (size_t r = 0; r < out.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_TRUE(out[r].ok()) << out[r].status();
    const QuantizedTensor& got = out[r]->tensor;
    ASSERT_TRUE(got.rowwise_data.has_value() && got.rowwise_scale_inv.has_value());
    EXPECT_EQ(got.rowwise_data->dtype, DataDType(w.config));
    EXPECT_TRUE(got.rowwise_data->data == w.data) << "gathered bytes differ from QuantizeBlock's";
    EXPECT_TRUE(got.rowwise_scale_inv->data == w.scale);
    EXPECT_EQ(got.config.format, w.config.format);
    EXPECT_EQ(got.config.force_pow2_scales, w.config.force_pow2_scales);
    EXPECT_EQ(out[r]->ranges, ranges);
  }
}

TEST_P(ParamAllGatherE2eTest, ShardsOfTheReferenceQuantizationGatherToIt) {
  const int world = GetParam();
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  const int64_t m = 257, n = 385;  // partial tiles on both edges
  const int64_t total = m * n;
  struct Case {
    QuantizeConfig config;
    std::vector<ShardRange> ranges;
  };
  std::vector<Case> cases;
  const QuantizeConfig e4m3 = {.scaling_mode = ScalingMode::kBlock2D};
  const QuantizeConfig e5m2 = {.scaling_mode = ScalingMode::kBlock2D,
                               .format = Fp8Format::kE5M2,
                               .force_pow2_scales = false};
  if (world == 2) {
    cases = {{e4m3, {{0, 128 * n + 3}, {128 * n + 3, total}}},
             {e5m2, {{1, total}, {0, 1}}},  // a one-element shard, out of rank order
             {e4m3, {{0, total}, {total, total}}}};
  } else {
    cases = {{e4m3, {{0, 129}, {129, 40000}, {40000, total}}},  // rank 0: one row and a bit
             {e5m2, {{70000, total}, {500, 70000}, {0, 500}}},  // reversed
             {e4m3, {{0, 0}, {0, total}, {total, total}}}};
  }
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(absl::StrCat("case ", k));
    const QuantizedWhole w =
        QuantizeWhole(m, n, cases[k].config, 7 + static_cast<uint32_t>(k), 3.0f);
    std::vector<QuantizedTensor> shards;
    for (int r = 0; r < world; ++r) shards.push_back(ShardOf(w, cases[k].ranges[r]));
    ASSERT_NO_FATAL_FAILURE(
        ExpectWhole(GatherOnEveryRank(ranks, shards, cases[k].ranges), w, cases[k].ranges));
  }

  // In place in shared memory: each rank's parameter buffer is a region
  // holding its shard at its offset (the rest garbage); the output is the
  // whole buffer, the scales are passed in the output's own slice.
  const QuantizedWhole w = QuantizeWhole(m, n, e4m3, 99, 3.0f);
  const std::vector<ShardRange>& ranges = cases[0].ranges;
  const uint64_t scale_off = (static_cast<uint64_t>(total) + 63) / 64 * 64;
  std::vector<std::unique_ptr<ShmRegion>> regions;
  std::vector<QuantizedTensor> shards;
  std::vector<QuantizeOutputs> outs;
  for (int r = 0; r < world; ++r) {
    auto region = ShmRegion::Create(absl::StrCat("param-", r), scale_off + w.scale.size());
    ASSERT_TRUE(region.ok()) << region.status();
    std::byte* base = (*region)->data();
    std::memset(base, 0xCD, scale_off);
    const ShardRange g = ranges[r];
    std::memcpy(base + g.begin, w.data.data() + g.begin, static_cast<size_t>(g.end - g.begin));
    std::memcpy(base + scale_off, w.scale.data(), w.scale.size());
    QTX_ASSERT_OK(ranks.clients[r]->RegisterShmRegion(**region));
    const std::string name = (*region)->name();
    QuantizedTensor q;
    q.shape = w.shape;
    q.config = w.config;
    q.rowwise_data = Tensor::InRegion(
        DType::kUInt8, {g.end - g.begin},
        {name, static_cast<uint64_t>(g.begin), static_cast<uint64_t>(g.end - g.begin)});
    const RegionSlice scale_slice = {name, scale_off, w.scale.size()};
    q.rowwise_scale_inv =
        Tensor::InRegion(DType::kFloat32, {w.scale_rows, w.scale_cols}, scale_slice);
    QuantizeOutputs o;
    o.rowwise_data = RegionSlice{name, 0, static_cast<uint64_t>(total)};
    o.rowwise_scale_inv = scale_slice;
    shards.push_back(std::move(q));
    outs.push_back(std::move(o));
    regions.push_back(*std::move(region));
  }
  auto out = GatherOnEveryRank(ranks, shards, ranges, outs);
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE(absl::StrCat("in place, rank ", r));
    ASSERT_TRUE(out[r].ok()) << out[r].status();
    ASSERT_TRUE(out[r]->tensor.rowwise_data.has_value());
    EXPECT_TRUE(out[r]->tensor.rowwise_data->in_region());
    const std::byte* base = regions[r]->data();
    EXPECT_EQ(std::memcmp(base, w.data.data(), static_cast<size_t>(total)), 0)
        << "the region does not hold the whole parameter";
    EXPECT_EQ(std::memcmp(base + scale_off, w.scale.data(), w.scale.size()), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ParamAllGatherE2eTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat(info.param, "ranks"); });

// ---- Disagreements and bad requests ----------------------------------------------------------

TEST(ParamAllGatherErrorsE2eTest, DisagreementsFailEveryRankNamingTheRankAndField) {
  const int world = 3;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  const QuantizeConfig config = {.scaling_mode = ScalingMode::kBlock2D};
  const QuantizedWhole w = QuantizeWhole(200, 130, config, 5, 3.0f);
  const int64_t total = w.total();
  const std::vector<ShardRange> good = {{0, 10000}, {10000, 20000}, {20000, total}};
  auto shards_of = [&](const std::vector<ShardRange>& ranges) {
    std::vector<QuantizedTensor> s;
    for (int r = 0; r < world; ++r) s.push_back(ShardOf(w, ranges[r]));
    return s;
  };
  auto expect_all = [&](const std::vector<absl::StatusOr<ParameterAllGatherResult>>& out,
                        absl::StatusCode code, const std::string& what) {
    for (int r = 0; r < world; ++r) {
      EXPECT_THAT(out[r], StatusIs(code, HasSubstr(what))) << "rank " << r;
    }
  };

  // Scales: rank 2's differ in one tile.
  {
    auto s = shards_of(good);
    std::string& scale = s[2].rowwise_scale_inv->data;
    float v;
    std::memcpy(&v, scale.data() + 4, 4);
    v *= 2.0f;
    std::memcpy(scale.data() + 4, &v, 4);
    auto out = GatherOnEveryRank(ranks, s, good);
    expect_all(out, absl::StatusCode::kInvalidArgument,
               "ranks disagree on shard.rowwise_scale_inv: rank 0 has scales with digest");
    expect_all(out, absl::StatusCode::kInvalidArgument, "rank 2 has scales with digest");
  }
  // Ranges that overlap, leave a gap, or overrun.
  {
    const std::vector<ShardRange> overlap = {{0, 10000}, {9000, 20000}, {20000, total}};
    expect_all(GatherOnEveryRank(ranks, shards_of(overlap), overlap),
               absl::StatusCode::kInvalidArgument,
               "rank 0's shard [0, 10000) and rank 1's shard [9000, 20000) overlap");
    const std::vector<ShardRange> gap = {{0, 10000}, {10100, 20000}, {20000, total}};
    expect_all(GatherOnEveryRank(ranks, shards_of(gap), gap), absl::StatusCode::kInvalidArgument,
               "elements [10000, 10100) are owned by no rank");
    const std::vector<ShardRange> short_end = {{0, 10000}, {10000, 20000}, {20000, total - 1}};
    expect_all(GatherOnEveryRank(ranks, shards_of(short_end), short_end),
               absl::StatusCode::kInvalidArgument,
               absl::StrCat("elements [", total - 1, ", ", total, ") are owned by no rank"));
  }
  // Shape: rank 1 calls it [130, 200] (the same element count and scale
  // shape, so its own request is fine).
  {
    auto s = shards_of(good);
    s[1].shape = {130, 200};
    expect_all(GatherOnEveryRank(ranks, s, good), absl::StatusCode::kInvalidArgument,
               "ranks disagree on shard.shape: rank 0 has [200, 130], rank 1 has [130, 200]");
  }
  // Config: rank 2 without power-of-two scales.
  {
    auto s = shards_of(good);
    s[2].config.force_pow2_scales = false;
    expect_all(GatherOnEveryRank(ranks, s, good), absl::StatusCode::kInvalidArgument,
               "ranks disagree on shard.config.force_pow2_scales: rank 0 has true, rank 2 has "
               "false");
  }
  // A bad request on one rank: its own error there, named on the others.
  {
    auto s = shards_of(good);
    s[1].config.format = Fp8Format::kE5M2;  // its data is still typed E4M3
    auto out = GatherOnEveryRank(ranks, s, good);
    EXPECT_THAT(out[1], StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("shard.rowwise_data.dtype=FLOAT8_E4M3")));
    for (int r : {0, 2}) {
      EXPECT_THAT(out[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("rank 1's request failed: shard.rowwise_data.dtype")))
          << "rank " << r;
    }
    s = shards_of(good);
    s[0].config.scaling_mode = ScalingMode::kBlock1D;
    out = GatherOnEveryRank(ranks, s, good);
    expect_all(out, absl::StatusCode::kInvalidArgument, "scaling_mode=BLOCK_1D: must be BLOCK_2D");
    s = shards_of(good);
    s[2].columnwise_data = Tensor::Inline(DType::kUInt8, {1}, std::string(1, '\0'));
    out = GatherOnEveryRank(ranks, s, good);
    expect_all(out, absl::StatusCode::kInvalidArgument, "only the rowwise copy is gathered");
    s = shards_of(good);
    s[0].rowwise_data->data.pop_back();  // one byte short
    s[0].rowwise_data->shape = {9999};
    out = GatherOnEveryRank(ranks, s, good);
    expect_all(out, absl::StatusCode::kInvalidArgument, "expected end - begin = 10000");
    s = shards_of(good);
    s[1].rowwise_scale_inv->shape = {4, 2};
    out = GatherOnEveryRank(ranks, s, good);
    expect_all(out, absl::StatusCode::kInvalidArgument,
               "shard.rowwise_scale_inv.shape=[4, 2]: expected [2, 4]");
  }
  // The group is still usable.
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(GatherOnEveryRank(ranks, shards_of(good), good), w, good));
  auto groups = ranks.clients[0]->ListGroups();
  ASSERT_TRUE(groups.ok()) << groups.status();
  ASSERT_EQ(groups->size(), 1u);
  EXPECT_EQ((*groups)[0].state, GroupState::kReady);
}

TEST(ParamAllGatherErrorsE2eTest, AnotherCollectiveAtTheSameSequenceFailsBothRanks) {
  const int world = 2;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks, absl::Seconds(5)));
  const QuantizeConfig config = {.scaling_mode = ScalingMode::kBlock2D};
  const QuantizedWhole w = QuantizeWhole(200, 130, config, 8, 3.0f);
  const std::vector<ShardRange> ranges = {{0, 13000}, {13000, w.total()}};
  // Rank 0 all-gathers a parameter, rank 1 an activation shard: neither may
  // report a result, and neither may wait past the group's deadline.
  std::vector<absl::Status> st(world);
  const absl::Time start = absl::Now();
  OnEveryRank(world, [&](int r) {
    if (r == 0) {
      st[r] = ranks.clients[0]
                  ->AllGatherParameter("dp", 0, ShardOf(w, ranges[0]), ranges[0], {},
                                       Deadline(absl::Seconds(30)))
                  .status();
    } else {
      const std::vector<float> x = SpreadValues(64 * 130, 3, 1.0f);
      st[r] = ranks.clients[1]
                  ->AllGather("dp", 0, Tensor::FromFloat32({64, 130}, x), config,
                              AllGatherMode::kExactFp8, {}, Deadline(absl::Seconds(30)))
                  .status();
    }
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(25));
  for (int r = 0; r < world; ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r << " got a result";
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kInvalidArgument,
                              HasSubstr("every rank must call AllGatherParameter")))
      << st[0];
  // Found out in step: the group is still usable.
  ranks.sequence = 1;
  std::vector<QuantizedTensor> shards;
  for (int r = 0; r < world; ++r) shards.push_back(ShardOf(w, ranges[r]));
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(GatherOnEveryRank(ranks, shards, ranges), w, ranges));
}

TEST(ParamAllGatherErrorsE2eTest, ARankThatDiesFailsTheOthers) {
  const int world = 3;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks, absl::Seconds(5)));
  const QuantizeConfig config = {.scaling_mode = ScalingMode::kBlock2D};
  const QuantizedWhole w = QuantizeWhole(200, 130, config, 6, 3.0f);
  const std::vector<ShardRange> ranges = {{0, 100}, {100, 20000}, {20000, w.total()}};
  // One good call first, then rank 2's sidecar dies.
  std::vector<QuantizedTensor> shards;
  for (int r = 0; r < world; ++r) shards.push_back(ShardOf(w, ranges[r]));
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(GatherOnEveryRank(ranks, shards, ranges), w, ranges));
  const pid_t pid = ranks.servers[2]->pid();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  const uint64_t seq = ranks.sequence++;
  std::vector<absl::StatusOr<ParameterAllGatherResult>> out(2);
  const absl::Time start = absl::Now();
  OnEveryRank(2, [&](int r) {
    out[r] = ranks.clients[r]->AllGatherParameter("dp", seq, shards[r], ranges[r], {},
                                                  Deadline(absl::Seconds(30)));
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(25)) << "the survivors waited for their deadline";
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(out[r].ok()) << "rank " << r << " got a result without rank 2";
    EXPECT_THAT(out[r].status().code(),
                AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kAborted,
                      absl::StatusCode::kUnavailable))
        << "rank " << r << ": " << out[r].status();
    EXPECT_THAT(std::string(out[r].status().message()), HasSubstr("AllGatherParameter"))
        << "rank " << r;
  }
  auto groups = ranks.clients[0]->ListGroups();
  ASSERT_TRUE(groups.ok()) << groups.status();
  ASSERT_EQ(groups->size(), 1u);
  EXPECT_EQ((*groups)[0].state, GroupState::kBroken);
}

}  // namespace
}  // namespace qtx::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::testing::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}

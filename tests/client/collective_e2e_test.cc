// End-to-end: qtx::Client's Collective calls against 2 and 3 qtxd processes
// it starts (--qtxd=<path>, --device=cpu), each on its own unix socket; rank
// 0's socket is the coordinator, so the Gloo group forms on loopback with no
// fixed ports. One thread per rank calls its own sidecar through its own
// Client. Every rank's AllGather result must equal kernels::cpu::QuantizeBlock
// of the concatenated shards byte for byte (inline and region outputs, both
// modes, 1-D and 2-D scaling, shards of 0 and non-multiple-of-128 rows); plus
// shard_rows, ListGroups, DestroyGroup and the mismatched-N error. Also the
// Optimizer's GradNorm reduced over the group (2 and 3 ranks): every rank
// gets the same totals, the sum of the ranks' contributions in rank order.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_ranks.h"
#include "tests/testing/status_matchers.h"

namespace qtx::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::string g_qtxd_path;  // from --qtxd=

constexpr absl::Duration kGroupTimeout = absl::Seconds(20);

// `world` sidecars and one client each.
using Ranks = QtxdRanks;

void StartRanks(int world, Ranks* ranks) {
  QTX_ASSERT_OK(StartQtxdRanks(
      g_qtxd_path, world,
      [](int) {
        return std::vector<std::string>{"--device=cpu", "--threads=2", "--allow_client_shm"};
      },
      ranks));
}

// CreateGroup `name` on every rank through the client calls.
void CreateGroupOnEveryRank(Ranks& ranks, const std::string& name) {
  const int world = ranks.world();
  const auto infos = CreateGlooGroupOnEveryRank(ranks, name, kGroupTimeout);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(infos[r].ok()) << "rank " << r << ": " << infos[r].status();
    EXPECT_EQ(infos[r]->name, name);
    EXPECT_EQ(infos[r]->rank, r);
    EXPECT_EQ(infos[r]->world_size, world);
    EXPECT_EQ(infos[r]->backend, CommBackend::kGloo);
    EXPECT_EQ(infos[r]->state, GroupState::kReady);
    EXPECT_EQ(infos[r]->next_sequence, 0u);
  }
}

// The global [m, n] FLOAT32 tensor; rank r's shard is rows
// [offset(r), offset(r) + rows[r]). Magnitudes differ per rank, so blocks
// straddling two ranks take their amax from one side only.
struct Shards {
  std::vector<int64_t> rows;
  int64_t n = 0;
  int64_t m = 0;
  std::vector<float> x;

  int64_t Offset(int rank) const {
    int64_t off = 0;
    for (int r = 0; r < rank; ++r) off += rows[r];
    return off;
  }
  // Rank `rank`'s shard as an inline tensor of `dtype` (FLOAT32 or BFLOAT16).
  Tensor Shard(int rank, DType dtype) const {
    const float* begin = x.data() + Offset(rank) * n;
    const int64_t count = rows[rank] * n;
    if (dtype == DType::kBFloat16) {
      std::string bytes(count * 2, '\0');
      for (int64_t i = 0; i < count; ++i) {
        const uint16_t b = kernels::FloatToBf16(begin[i]);
        std::memcpy(bytes.data() + 2 * i, &b, 2);
      }
      return Tensor::Inline(DType::kBFloat16, {rows[rank], n}, std::move(bytes));
    }
    return Tensor::FromFloat32({rows[rank], n}, std::span<const float>(begin, count));
  }
};

Shards MakeShards(std::vector<int64_t> rows, int64_t n, bool bf16_exact) {
  Shards s;
  s.rows = std::move(rows);
  s.n = n;
  for (int64_t r : s.rows) s.m += r;
  s.x.resize(s.m * n);
  std::mt19937 rng(static_cast<uint32_t>(s.m * 131 + n));
  std::normal_distribution<float> d(0.0f, 1.0f);
  int64_t i = 0;
  for (size_t r = 0; r < s.rows.size(); ++r) {
    const float mag = std::ldexp(1.0f, static_cast<int>((r * 5) % 11) - 4);
    for (int64_t j = 0; j < s.rows[r] * n; ++j, ++i) {
      s.x[i] = d(rng) * mag;
      // Values a BF16 shard carries exactly, so the FLOAT32 reference holds.
      if (bf16_exact) s.x[i] = kernels::Bf16ToFloat(kernels::FloatToBf16(s.x[i]));
    }
  }
  return s;
}

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

// kernels::cpu::QuantizeBlock of the whole tensor.
struct Reference {
  std::string rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv;
};

Reference QuantizeReference(const Shards& s, const QuantizeConfig& c) {
  kernels::QuantizeParams p;
  p.scaling = c.scaling_mode == ScalingMode::kBlock2D  ? kernels::BlockScaling::kBlock2D
              : c.scaling_mode == ScalingMode::kTensor ? kernels::BlockScaling::kTensor
                                                       : kernels::BlockScaling::kBlock1D;
  p.format = c.format == Fp8Format::kE5M2 ? kernels::Fp8Format::kE5M2 : kernels::Fp8Format::kE4M3;
  p.rowwise = c.rowwise;
  p.columnwise = c.columnwise;
  p.force_pow2_scales = c.force_pow2_scales;
  p.amax_epsilon = c.amax_epsilon;
  const kernels::QuantizedLayout l = kernels::ComputeLayout(p.scaling, s.m, s.n);
  std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  kernels::cpu::QuantizeBlock(s.x.data(), kernels::InputDType::kFloat32, s.m, s.n, p,
                              {rd.data(), rs.data(), cd.data(), cs.data()});
  Reference ref;
  if (c.rowwise) {
    ref.rowwise_data = Bytes(rd.data(), rd.size());
    ref.rowwise_scale_inv = Bytes(rs.data(), rs.size() * sizeof(float));
  }
  if (c.columnwise) {
    ref.columnwise_data = Bytes(cd.data(), cd.size());
    ref.columnwise_scale_inv = Bytes(cs.data(), cs.size() * sizeof(float));
  }
  return ref;
}

// The bytes of an output: inline, or viewed in `region` (which must hold it).
std::string OutputBytes(const std::optional<Tensor>& t, const ShmRegion* region) {
  if (!t) return "<absent>";
  if (!t->region) return t->data;
  if (region == nullptr) return "<region output without a region>";
  absl::StatusOr<std::span<std::byte>> view = region->View(*t->region);
  if (!view.ok()) return "<" + view.status().ToString() + ">";
  return Bytes(view->data(), view->size());
}

void ExpectMatchesReference(const AllGatherResult& got, const Shards& s, const QuantizeConfig& c,
                            DType source_dtype, const Reference& ref, const ShmRegion* region) {
  EXPECT_THAT(got.shard_rows, ElementsAreArray(s.rows));
  EXPECT_THAT(got.tensor.shape, ElementsAre(s.m, s.n));
  EXPECT_EQ(got.tensor.source_dtype, source_dtype);
  EXPECT_EQ(got.tensor.config, c);
  const DType fp8 = c.format == Fp8Format::kE5M2 ? DType::kFloat8E5M2 : DType::kFloat8E4M3;
  if (c.rowwise) {
    ASSERT_TRUE(got.tensor.rowwise_data.has_value());
    EXPECT_EQ(got.tensor.rowwise_data->dtype, fp8);
    EXPECT_THAT(got.tensor.rowwise_data->shape, ElementsAre(s.m, s.n));
    EXPECT_TRUE(OutputBytes(got.tensor.rowwise_data, region) == ref.rowwise_data)
        << "rowwise data differs from QuantizeBlock(concat)";
    EXPECT_TRUE(OutputBytes(got.tensor.rowwise_scale_inv, region) == ref.rowwise_scale_inv)
        << "rowwise scale_inv differs from QuantizeBlock(concat)";
  } else {
    EXPECT_FALSE(got.tensor.rowwise_data.has_value());
  }
  if (c.columnwise) {
    ASSERT_TRUE(got.tensor.columnwise_data.has_value());
    EXPECT_THAT(got.tensor.columnwise_data->shape, ElementsAre(s.n, s.m));
    EXPECT_TRUE(OutputBytes(got.tensor.columnwise_data, region) == ref.columnwise_data)
        << "columnwise data differs from QuantizeBlock(concat)";
    EXPECT_TRUE(OutputBytes(got.tensor.columnwise_scale_inv, region) == ref.columnwise_scale_inv)
        << "columnwise scale_inv differs from QuantizeBlock(concat)";
  } else {
    EXPECT_FALSE(got.tensor.columnwise_data.has_value());
  }
}

// AllGather on every rank with rank r's shard; returns the per-rank results.
std::vector<absl::StatusOr<AllGatherResult>> AllGatherOnEveryRank(
    Ranks& ranks, const std::string& group, uint64_t sequence,
    const std::function<Tensor(int)>& input, const QuantizeConfig& config, AllGatherMode mode,
    const std::function<QuantizeOutputs(int)>& outputs = nullptr) {
  const int world = ranks.world();
  std::vector<absl::StatusOr<AllGatherResult>> out(world, absl::UnknownError("not called"));
  OnEveryRank(world, [&](int r) {
    out[r] = ranks.clients[r]->AllGather(group, sequence, input(r), config, mode,
                                         outputs ? outputs(r) : QuantizeOutputs{},
                                         Deadline(absl::Seconds(30)));
  });
  return out;
}

class ClientCollectiveE2eTest : public ::testing::TestWithParam<int> {};

TEST_P(ClientCollectiveE2eTest, AllGatherMatchesQuantizeOfConcatenation) {
  const int world = GetParam();
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  ASSERT_NO_FATAL_FAILURE(CreateGroupOnEveryRank(ranks, "tp"));

  std::vector<std::vector<int64_t>> grids;
  if (world == 2) grids = {{0, 300}, {64, 64}};
  if (world == 3) grids = {{100, 156, 1}, {129, 0, 127}};
  uint64_t sequence = 0;
  for (const std::vector<int64_t>& rows : grids) {
    for (int64_t n : {100, 256}) {
      const Shards s = MakeShards(rows, n, /*bf16_exact=*/false);
      for (ScalingMode scaling :
           {ScalingMode::kBlock1D, ScalingMode::kBlock2D, ScalingMode::kTensor}) {
        QuantizeConfig c;
        c.scaling_mode = scaling;
        c.columnwise = true;
        const Reference ref = QuantizeReference(s, c);
        for (AllGatherMode mode : {AllGatherMode::kExactFp8, AllGatherMode::kGatherHighPrecision}) {
          SCOPED_TRACE(absl::StrFormat("world=%d rows=%s n=%d %s %s", world,
                                       ::testing::PrintToString(rows), n, ScalingModeName(scaling),
                                       AllGatherModeName(mode)));
          auto results = AllGatherOnEveryRank(
              ranks, "tp", sequence++, [&](int r) { return s.Shard(r, DType::kFloat32); }, c, mode);
          for (int r = 0; r < world; ++r) {
            SCOPED_TRACE(absl::StrCat("rank ", r));
            ASSERT_TRUE(results[r].ok()) << results[r].status();
            ExpectMatchesReference(*results[r], s, c, DType::kFloat32, ref, nullptr);
          }
        }
      }
    }
  }

  // BF16 shards, E5M2, rowwise only, non-pow2 scales: the config travels whole.
  {
    const Shards s =
        MakeShards(world == 2 ? std::vector<int64_t>{130, 77} : std::vector<int64_t>{100, 156, 1},
                   300, /*bf16_exact=*/true);
    QuantizeConfig c;
    c.format = Fp8Format::kE5M2;
    c.force_pow2_scales = false;
    c.amax_epsilon = 1e-6f;
    const Reference ref = QuantizeReference(s, c);
    auto results = AllGatherOnEveryRank(
        ranks, "tp", sequence++, [&](int r) { return s.Shard(r, DType::kBFloat16); }, c,
        AllGatherMode::kExactFp8);
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(absl::StrCat("bf16, rank ", r));
      ASSERT_TRUE(results[r].ok()) << results[r].status();
      ExpectMatchesReference(*results[r], s, c, DType::kBFloat16, ref, nullptr);
    }
  }

  // ListGroups on every rank: the group, READY, and the sequence it expects.
  for (int r = 0; r < world; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(std::vector<CollectiveGroupInfo> groups,
                             ranks.clients[r]->ListGroups());
    ASSERT_EQ(groups.size(), 1u) << "rank " << r;
    EXPECT_EQ(groups[0].name, "tp");
    EXPECT_EQ(groups[0].rank, r);
    EXPECT_EQ(groups[0].world_size, world);
    EXPECT_EQ(groups[0].backend, CommBackend::kGloo);
    EXPECT_EQ(groups[0].state, GroupState::kReady);
    EXPECT_EQ(groups[0].next_sequence, sequence);
    EXPECT_EQ(groups[0].error, "");
  }

  // DestroyGroup on every rank; then the group is gone.
  for (int r = 0; r < world; ++r) QTX_ASSERT_OK(ranks.clients[r]->DestroyGroup("tp"));
  for (int r = 0; r < world; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(std::vector<CollectiveGroupInfo> groups,
                             ranks.clients[r]->ListGroups());
    EXPECT_TRUE(groups.empty()) << "rank " << r;
    EXPECT_THAT(ranks.clients[r]->DestroyGroup("tp"),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("tp")));
  }
  const Shards s = MakeShards(std::vector<int64_t>(world, 8), 128, false);
  EXPECT_THAT(ranks.clients[0]->AllGather("tp", sequence, s.Shard(0, DType::kFloat32), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("tp")));
}

INSTANTIATE_TEST_SUITE_P(Ranks, ClientCollectiveE2eTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("World", info.param);
                         });

// Inputs and outputs in shm regions registered with each rank's sidecar.
TEST(ClientCollectiveE2e, AllGatherIntoRegionOutputs) {
  const int world = 2;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  ASSERT_NO_FATAL_FAILURE(CreateGroupOnEveryRank(ranks, "regions"));
  const Shards s = MakeShards({200, 57}, 300, /*bf16_exact=*/false);
  std::vector<std::unique_ptr<ShmRegion>> regions;
  for (int r = 0; r < world; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> region,
                             ShmRegion::Create(absl::StrCat("coll-", r), 4 << 20));
    QTX_ASSERT_OK(ranks.clients[r]->RegisterShmRegion(*region));
    regions.push_back(std::move(region));
  }
  uint64_t sequence = 0;
  for (ScalingMode scaling : {ScalingMode::kBlock1D, ScalingMode::kBlock2D, ScalingMode::kTensor}) {
    for (AllGatherMode mode : {AllGatherMode::kExactFp8, AllGatherMode::kGatherHighPrecision}) {
      SCOPED_TRACE(absl::StrFormat("%s %s", ScalingModeName(scaling), AllGatherModeName(mode)));
      QuantizeConfig c;
      c.scaling_mode = scaling;
      c.columnwise = true;
      const Reference ref = QuantizeReference(s, c);
      std::vector<Tensor> inputs;
      std::vector<QuantizeOutputs> outputs;
      for (int r = 0; r < world; ++r) {
        regions[r]->Reset();
        QTX_ASSERT_OK_AND_ASSIGN(Tensor in, regions[r]->Place(s.Shard(r, DType::kFloat32)));
        const std::vector<int64_t> shape = {s.m, s.n};
        QTX_ASSERT_OK_AND_ASSIGN(QuantizeOutputs out,
                                 regions[r]->AllocateQuantizeOutputs(shape, c));
        inputs.push_back(std::move(in));
        outputs.push_back(std::move(out));
      }
      auto results = AllGatherOnEveryRank(
          ranks, "regions", sequence++, [&](int r) { return inputs[r]; }, c, mode,
          [&](int r) { return outputs[r]; });
      for (int r = 0; r < world; ++r) {
        SCOPED_TRACE(absl::StrCat("rank ", r));
        ASSERT_TRUE(results[r].ok()) << results[r].status();
        const QuantizedTensor& q = results[r]->tensor;
        ASSERT_TRUE(q.rowwise_data && q.rowwise_data->region);
        EXPECT_EQ(*q.rowwise_data->region, *outputs[r].rowwise_data);
        ASSERT_TRUE(q.columnwise_scale_inv && q.columnwise_scale_inv->region);
        EXPECT_EQ(*q.columnwise_scale_inv->region, *outputs[r].columnwise_scale_inv);
        ExpectMatchesReference(*results[r], s, c, DType::kFloat32, ref, regions[r].get());
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    QTX_EXPECT_OK(ranks.clients[r]->DestroyGroup("regions"));
    QTX_EXPECT_OK(ranks.clients[r]->UnregisterRegion(absl::StrCat("coll-", r)));
  }
}

// Ranks that disagree on N fail on every rank with INVALID_ARGUMENT naming
// the field; the group stays usable with the next sequence number.
TEST(ClientCollectiveE2e, MismatchedNFailsOnEveryRank) {
  const int world = 3;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  ASSERT_NO_FATAL_FAILURE(CreateGroupOnEveryRank(ranks, "bad"));
  const Shards a = MakeShards({64, 64, 64}, 128, false);
  const Shards b = MakeShards({64, 64, 64}, 100, false);
  auto results = AllGatherOnEveryRank(
      ranks, "bad", 0,
      [&](int r) { return r == 2 ? b.Shard(r, DType::kFloat32) : a.Shard(r, DType::kFloat32); },
      QuantizeConfig{}, AllGatherMode::kExactFp8);
  for (int r = 0; r < world; ++r) {
    EXPECT_THAT(results[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("disagree on n: rank 0 has 128, rank 2 has 100")))
        << "rank " << r;
  }
  for (int r = 0; r < world; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(std::vector<CollectiveGroupInfo> groups,
                             ranks.clients[r]->ListGroups());
    ASSERT_EQ(groups.size(), 1u);
    EXPECT_EQ(groups[0].state, GroupState::kReady) << groups[0].error;
    EXPECT_EQ(groups[0].next_sequence, 1u);
  }
  const QuantizeConfig c;
  const Reference ref = QuantizeReference(a, c);
  results = AllGatherOnEveryRank(
      ranks, "bad", 1, [&](int r) { return a.Shard(r, DType::kFloat32); }, c,
      AllGatherMode::kExactFp8);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    ExpectMatchesReference(*results[r], a, c, DType::kFloat32, ref, nullptr);
  }
}

// Errors the server finds before any peer is involved keep code and message.
// GradNorm with collective_group: each rank holds its own optimizer group
// (a tensor/pipeline-parallel shard of the model); the sidecars add the
// contributions among themselves. Then every rank steps with the same clip
// factor, or skips together after an Inf on one rank; ranks that measured
// different steps all fail.
class GradNormReduceE2eTest : public ::testing::TestWithParam<int> {};

TEST_P(GradNormReduceE2eTest, EveryRankGetsTheSameTotalsAndDecides) {
  const int world = GetParam();
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  ASSERT_NO_FATAL_FAILURE(CreateGroupOnEveryRank(ranks, "tp"));
  // Rank r's parameter: [100 + 37 r, 64 + r] (partial tiles), its own seeds.
  auto shape = [](int r) { return std::vector<int64_t>{100 + 37 * r, 64 + r}; };
  auto values = [&](int r, uint32_t seed, float scale) {
    std::mt19937 rng(seed * 17 + r);
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(shape(r)[0] * shape(r)[1]);
    for (float& x : v) x = d(rng);
    return v;
  };
  OnEveryRank(world, [&](int r) {
    OptimizerGroupConfig c;
    c.group = "opt";
    auto info = ranks.clients[r]->OffloadOptimizerState(
        c, {{.name = "w" + std::to_string(r),
             .shape = shape(r),
             .master = Tensor::FromFloat32(shape(r), values(r, 1, 0.1f)),
             .exp_avg = std::nullopt,
             .exp_avg_sq = std::nullopt}});
    EXPECT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
  });
  uint64_t sequence = 0;
  auto grads = [&](int r, uint32_t seed) {
    return std::vector<OptimizerGradient>{
        {"w" + std::to_string(r), Tensor::FromFloat32(shape(r), values(r, seed, 1.0f))}};
  };
  auto reduce_on_every_rank = [&](int64_t step,
                                  const std::function<std::vector<OptimizerGradient>(int)>& g) {
    std::vector<absl::StatusOr<GradNormResult>> out(world);
    const uint64_t seq = sequence++;
    OnEveryRank(world, [&](int r) {
      out[r] = ranks.clients[r]->GradNorm(
          "opt", step, g(r), {.collective_group = "tp", .sequence = seq}, Deadline(kGroupTimeout));
    });
    return out;
  };

  // Step 1: the totals, bit for bit the rank-order sum on every rank.
  std::vector<absl::StatusOr<GradNormResult>> n =
      reduce_on_every_rank(1, [&](int r) { return grads(r, 2); });
  double rank_order_sum = 0.0, independent = 0.0;
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(n[r].ok()) << "rank " << r << ": " << n[r].status();
    rank_order_sum += n[r]->sum_squares;
    for (float x : values(r, 2, 1.0f)) independent += static_cast<double>(x) * x;
  }
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(n[r]->ranks, world);
    EXPECT_EQ(n[r]->total_sum_squares, rank_order_sum) << "rank " << r;
    EXPECT_FALSE(n[r]->total_non_finite);
    EXPECT_EQ(n[r]->step, 1);
  }
  EXPECT_NEAR(rank_order_sum, independent, 1e-12 * independent);
  const double clip = ClipFactor(rank_order_sum, 10.0);
  EXPECT_LT(clip, 1.0);
  OnEveryRank(world, [&](int r) {
    StepOptions so;
    so.clip_factor = clip;
    so.omit_parameters = true;
    auto s = ranks.clients[r]->Step("opt", 1, grads(r, 2), so);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    EXPECT_EQ(s->stats.clip_coef, clip);
  });

  // Step 2: an Inf on the last rank only; every rank learns it and skips.
  n = reduce_on_every_rank(2, [&](int r) {
    std::vector<OptimizerGradient> g = grads(r, 3);
    if (r == world - 1) {
      std::vector<float> v = values(r, 3, 1.0f);
      v[5] = std::numeric_limits<float>::infinity();
      g[0].grad = Tensor::FromFloat32(shape(r), v);
    }
    return g;
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(n[r].ok()) << "rank " << r << ": " << n[r].status();
    EXPECT_EQ(n[r]->non_finite, r == world - 1) << "rank " << r;
    EXPECT_TRUE(n[r]->total_non_finite) << "rank " << r;
  }
  OnEveryRank(world, [&](int r) {
    StepOptions so;
    so.skip = n[r]->total_non_finite;
    so.omit_parameters = true;
    auto s = ranks.clients[r]->Step("opt", 2, {}, so);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    EXPECT_TRUE(s->stats.skipped);
  });

  // Ranks at different steps (rank 0 retries step 2): every rank fails.
  n = reduce_on_every_rank(3, [&](int r) { return grads(r, 4); });
  for (int r = 0; r < world; ++r) ASSERT_TRUE(n[r].ok()) << n[r].status();
  const uint64_t seq = sequence++;
  std::vector<absl::StatusOr<GradNormResult>> mixed(world);
  OnEveryRank(world, [&](int r) {
    mixed[r] = ranks.clients[r]->GradNorm("opt", r == 0 ? 2 : 3, grads(r, 4),
                                          {.collective_group = "tp", .sequence = seq},
                                          Deadline(kGroupTimeout));
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_THAT(mixed[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("rank 0 measured step 2 but rank 1 measured step 3")))
        << "rank " << r;
  }
  // A rank whose own measurement fails (an unknown optimizer group) still
  // takes part: the others fail at once, naming it.
  const uint64_t seq2 = sequence++;
  OnEveryRank(world, [&](int r) {
    mixed[r] = ranks.clients[r]->GradNorm(r == 1 ? "nope" : "opt", 3, grads(r, 4),
                                          {.collective_group = "tp", .sequence = seq2},
                                          Deadline(kGroupTimeout));
  });
  for (int r = 0; r < world; ++r) {
    if (r == 1) {
      EXPECT_THAT(mixed[r], StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
    } else {
      EXPECT_THAT(mixed[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                     HasSubstr("rank 1 could not measure its gradients")))
          << "rank " << r;
    }
  }
  // A used sequence and an unknown Collective group are refused.
  EXPECT_THAT(
      ranks.clients[0]->GradNorm("opt", 3, grads(0, 4), {.collective_group = "tp", .sequence = 0}),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("sequence")));
  EXPECT_THAT(ranks.clients[0]->GradNorm("opt", 3, grads(0, 4), {.collective_group = "nope"}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  for (int r = 0; r < world; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupList l, ranks.clients[r]->ListOptimizerGroups());
    ASSERT_EQ(l.groups.size(), 1u);
    EXPECT_EQ(l.groups[0].step, 2) << "rank " << r;  // GradNorm changed nothing
    QTX_EXPECT_OK(ranks.clients[r]->DestroyGroup("tp"));
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GradNormReduceE2eTest, ::testing::Values(2, 3));

TEST(ClientCollectiveE2e, CreateGroupErrorsKeepServerCodeAndMessage) {
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(1, &ranks));
  Client& client = *ranks.clients[0];
  EXPECT_THAT(client.CreateGroup({.name = "g", .rank = 1, .world_size = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("coordinator")));
  EXPECT_THAT(client.CreateGroup({.name = "g", .rank = 2, .world_size = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  EXPECT_THAT(client.CreateGroup({.name = "g", .timeout = absl::Milliseconds(-5)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  EXPECT_THAT(client.AllGather("nope", 0, Tensor::FromFloat32({1, 1}, std::vector<float>{1}), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  // A group of one is a group: AllGather is Quantize.
  QTX_ASSERT_OK_AND_ASSIGN(CollectiveGroupInfo info,
                           client.CreateGroup({.name = "solo", .backend = CommBackend::kGloo}));
  EXPECT_EQ(info.state, GroupState::kReady);
  EXPECT_THAT(client.CreateGroup({.name = "solo"}),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("solo")));
  QTX_EXPECT_OK(client.DestroyGroup("solo"));
}

}  // namespace
}  // namespace qtx::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::testing::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}

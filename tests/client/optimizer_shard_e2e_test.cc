// End-to-end: data-parallel sharded optimizer state (docs/numerics.md §10)
// over 2 and 3 qtxd processes (--device=cpu) forming a Gloo Collective group.
// Each rank's sidecar owns contiguous slices of every parameter's flattened
// matrix at offsets that cut 128x128 tiles (mid-row, mid-tile, a slice
// smaller than one tile, empty slices); every rank steps its slices in one
// collective Step. The reference is an unsharded group with the whole
// parameters on rank 0's sidecar, stepped with the same gradients: each
// owner's FP8 shard must be its part of the reference's rowwise data byte for
// byte, its scale_inv tensors the reference's, its BF16 copy and master
// slice the reference's too, on every step, on a replay and after a
// checkpoint round trip. Plus the error cases: ranges that overlap or leave
// gaps, different step numbers, a rank that fails before the step, a sharded
// Step without a Collective group, options a sharded group refuses.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/client.h"
#include "tests/testing/qtxd_ranks.h"
#include "tests/testing/sharded_params.h"
#include "tests/testing/status_matchers.h"

namespace qtx::testing {
namespace {

using ::testing::HasSubstr;

std::string g_qtxd_path;  // from --qtxd=

constexpr absl::Duration kGroupTimeout = absl::Seconds(20);

struct Ranks : QtxdRanks {
  std::string dir;  // rank r's --checkpoint_dir is dir/rank<r>
};

void StartRanks(int world, Ranks* ranks) {
  char tmpl[] = "/tmp/qtx_shard_e2e.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  ranks->dir = tmpl;
  const std::string dir = ranks->dir;
  QTX_ASSERT_OK(StartQtxdRanks(
      g_qtxd_path, world,
      [&dir](int r) {
        return std::vector<std::string>{"--device=cpu", "--threads=2",
                                        absl::StrCat("--checkpoint_dir=", dir, "/rank", r),
                                        absl::StrCat("--checkpoint_import_dirs=", dir)};
      },
      ranks));
  const auto infos = CreateGlooGroupOnEveryRank(*ranks, "dp", kGroupTimeout);
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE(infos[r].ok()) << "rank " << r << ": " << infos[r].status();
}

// One parameter of the sharded buffer and every rank's range of it:
// rank r owns [cuts[r], cuts[r + 1]).
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<int64_t> cuts;
  std::optional<double> lr_scale = std::nullopt;
  int64_t total() const { return shape[0] * shape[1]; }
};

OptimizerGroupConfig GroupConfig(const std::string& name) {
  OptimizerGroupConfig c;
  c.group = name;
  c.hyper_params.lr = 1e-2;
  c.hyper_params.weight_decay = 0.1;
  c.output.bf16_copy = true;  // FP8 128x128 (rowwise + columnwise) and BF16
  return c;
}

class ShardedStepE2eTest : public ::testing::TestWithParam<int> {};

TEST_P(ShardedStepE2eTest, EveryOwnersShardIsItsPartOfTheWholeQuantizedParameter) {
  const int world = GetParam();
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  std::vector<Param> params;
  if (world == 2) {
    params = {
        {"w", {300, 260}, {0, 40000, 300 * 260}},  // cut mid-row, mid-tile
        {"b", {1, 200}, {0, 77, 200}, 0.5},        // one row: a slice smaller than a tile
        {"e", {130, 129}, {0, 0, 130 * 129}},      // rank 0 owns nothing of it
    };
  } else {
    params = {
        // Rank 1's slice: 50 elements inside one tile, ending mid-row.
        {"w", {300, 260}, {0, 128 * 260 + 77, 128 * 260 + 127, 300 * 260}},
        {"b", {1, 200}, {0, 200, 200, 200}, 0.5},  // rank 0 owns it all
        {"e", {130, 129}, {0, 5000, 9000, 130 * 129}},
    };
  }
  // Initial masters and per-step gradients of the whole parameters.
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
      inits.push_back(WholeInit(params[i].name, params[i].shape, master[i], params[i].lr_scale));
    }
    QTX_ASSERT_OK(ranks.clients[0]->OffloadOptimizerState(GroupConfig("ref"), inits).status());
  }
  // Every owner: the same parameters, its own slices.
  OnEveryRank(world, [&](int r) {
    std::vector<OptimizerParameterInit> inits;
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      inits.push_back(
          ShardInit(p.name, p.shape, master[i], {p.cuts[r], p.cuts[r + 1]}, p.lr_scale));
    }
    auto info = ranks.clients[r]->OffloadOptimizerState(GroupConfig("opt"), inits);
    ASSERT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
    int64_t owned = 0;
    for (const Param& p : params) owned += p.cuts[r + 1] - p.cuts[r];
    EXPECT_EQ(info->num_elements, owned);
    ASSERT_EQ(info->parameter_shards.size(), params.size());
    EXPECT_EQ(info->parameter_shards[0].range,
              (ShardRange{params[0].cuts[r], params[0].cuts[r + 1]}));
  });

  uint64_t sequence = 0;
  // One sharded step on every rank (clip factor optional), compared with the
  // reference's result of the same step.
  auto step_and_compare = [&](int64_t step, std::optional<double> clip, bool expect_replay,
                              const OptimizerStepResult& ref) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const uint64_t seq = sequence++;
    std::vector<absl::StatusOr<OptimizerStepResult>> out(world);
    OnEveryRank(world, [&](int r) {
      std::vector<OptimizerGradient> g;
      for (size_t i = 0; i < params.size(); ++i) {
        g.push_back(
            {params[i].name, Slice(grad(i, step), params[i].cuts[r], params[i].cuts[r + 1])});
      }
      StepOptions so;
      so.clip_factor = clip;
      so.collective_group = "dp";
      so.sequence = seq;
      out[r] = ranks.clients[r]->Step("opt", step, g, so, Deadline(kGroupTimeout));
    });
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status();
      EXPECT_EQ(out[r]->stats.replayed, expect_replay);
      ASSERT_EQ(out[r]->parameters.size(), params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        const Param& p = params[i];
        const int64_t b = p.cuts[r], e = p.cuts[r + 1];
        SCOPED_TRACE(absl::StrCat("rank ", r, " parameter ", p.name, " [", b, ", ", e, ")"));
        const ParameterOutput& o = out[r]->parameters[i];
        const ParameterOutput& want = ref.parameters[i];
        ASSERT_TRUE(o.fp8.has_value());
        ASSERT_TRUE(o.fp8->rowwise_data.has_value());
        EXPECT_EQ(o.fp8->rowwise_data->shape, std::vector<int64_t>{e - b});
        ASSERT_EQ(o.fp8->rowwise_data->data.size(), static_cast<size_t>(e - b));
        EXPECT_TRUE(o.fp8->rowwise_data->data == want.fp8->rowwise_data->data.substr(b, e - b))
            << "FP8 bytes differ from the whole parameter's";
        EXPECT_EQ(o.fp8->rowwise_scale_inv->data, want.fp8->rowwise_scale_inv->data);
        ASSERT_TRUE(o.fp8->columnwise_scale_inv.has_value());
        EXPECT_EQ(o.fp8->columnwise_scale_inv->data, want.fp8->columnwise_scale_inv->data);
        EXPECT_FALSE(o.fp8->columnwise_data.has_value());
        ASSERT_TRUE(o.bf16.has_value());
        EXPECT_TRUE(o.bf16->data == want.bf16->data.substr(2 * b, 2 * (e - b)));
      }
    }
  };
  auto reference_step = [&](int64_t step, std::optional<double> clip) {
    std::vector<OptimizerGradient> g;
    for (size_t i = 0; i < params.size(); ++i) {
      g.push_back({params[i].name, Tensor::FromFloat32(params[i].shape, grad(i, step))});
    }
    StepOptions so;
    so.clip_factor = clip;
    auto ref = ranks.clients[0]->Step("ref", step, g, so);
    EXPECT_TRUE(ref.ok()) << ref.status();
    return ref.ok() ? *std::move(ref) : OptimizerStepResult{};
  };

  const OptimizerStepResult ref1 = reference_step(1, std::nullopt);
  ASSERT_NO_FATAL_FAILURE(step_and_compare(1, std::nullopt, false, ref1));
  const OptimizerStepResult ref2 = reference_step(2, 0.25);
  ASSERT_NO_FATAL_FAILURE(step_and_compare(2, 0.25, false, ref2));
  // A retried step replays on every owner (the amaxes combined again).
  ASSERT_NO_FATAL_FAILURE(step_and_compare(2, 0.25, true, ref2));
  // Each sidecar checkpoints its slices; step 3, back to the checkpoint,
  // step 3 again: the same bytes.
  OnEveryRank(world, [&](int r) {
    auto saved = ranks.clients[r]->SaveCheckpoint("opt");
    EXPECT_TRUE(saved.ok()) << "rank " << r << ": " << saved.status();
  });
  const OptimizerStepResult ref3 = reference_step(3, std::nullopt);
  ASSERT_NO_FATAL_FAILURE(step_and_compare(3, std::nullopt, false, ref3));
  OnEveryRank(world, [&](int r) {
    auto loaded = ranks.clients[r]->LoadCheckpoint("opt");
    ASSERT_TRUE(loaded.ok()) << "rank " << r << ": " << loaded.status();
    EXPECT_EQ(loaded->step, 2);
    EXPECT_EQ(loaded->parameter_shards.size(), params.size());
  });
  ASSERT_NO_FATAL_FAILURE(step_and_compare(3, std::nullopt, false, ref3));

  // The master slices are the reference's.
  auto ref_state = ranks.clients[0]->GetState("ref");
  ASSERT_TRUE(ref_state.ok()) << ref_state.status();
  for (int r = 0; r < world; ++r) {
    auto state = ranks.clients[r]->GetState("opt");
    ASSERT_TRUE(state.ok()) << state.status();
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t b = params[i].cuts[r], e = params[i].cuts[r + 1];
      EXPECT_EQ(state->parameters[i].master.shape, std::vector<int64_t>{e - b});
      EXPECT_TRUE(state->parameters[i].master.data ==
                  ref_state->parameters[i].master.data.substr(4 * b, 4 * (e - b)))
          << "rank " << r << " " << params[i].name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Owners, ShardedStepE2eTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat(info.param, "owners"); });

// Resharding (docs/numerics.md §10.1): a group checkpointed by `from` owners
// is loaded by `to` owners at other ranges (every cut inside a tile), stepped
// on, checkpointed, loaded whole by one sidecar (sharded -> unsharded),
// stepped, checkpointed, and loaded at the first ranges again (unsharded ->
// sharded). At every step every owner's FP8 shard, scales and BF16 slice are
// byte for byte those of an unsharded group that never resharded, stepped
// with the same gradients; the masters are compared at the end.
struct ReshardCase {
  int from, to;
};

class ReshardE2eTest : public ::testing::TestWithParam<ReshardCase> {};

// Collective group `name` over ranks 0..world-1 of `ranks`.
void CreateDpGroup(Ranks& ranks, const std::string& name, int world) {
  const auto infos = CreateGlooGroupOnEveryRank(ranks, name, kGroupTimeout, world);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(infos[r].ok()) << "rank " << r << ": " << infos[r].status();
  }
}

// Every parameter's cuts for `owners` owners: cuts[i][r] .. cuts[i][r + 1].
using Cuts = std::vector<std::vector<int64_t>>;

TEST_P(ReshardE2eTest, ContinuesByteForByteAfterChangingTheDataParallelSize) {
  const ReshardCase rc = GetParam();
  const int world = std::max(rc.from, rc.to);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  ASSERT_NO_FATAL_FAILURE(CreateDpGroup(ranks, "dp_from", rc.from));
  ASSERT_NO_FATAL_FAILURE(CreateDpGroup(ranks, "dp_to", rc.to));
  struct P {
    std::string name;
    std::vector<int64_t> shape;
    std::optional<double> lr_scale = std::nullopt;
    int64_t total() const { return shape[0] * shape[1]; }
  };
  const std::vector<P> params = {{"w", {300, 260}}, {"b", {1, 200}, 0.5}, {"e", {130, 129}}};
  // Cuts inside tiles, mid-row, slices smaller than a tile, empty slices.
  const Cuts cuts2 = {{0, 40000, 78000}, {0, 77, 200}, {0, 0, 130 * 129}};
  const Cuts cuts3 = {
      {0, 128 * 260 + 77, 128 * 260 + 127, 78000}, {0, 200, 200, 200}, {0, 5000, 9000, 130 * 129}};
  const Cuts& from_cuts = rc.from == 2 ? cuts2 : cuts3;
  const Cuts& to_cuts = rc.to == 2 ? cuts2 : cuts3;

  std::vector<std::vector<float>> master(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    master[i] = SpreadValues(params[i].total(), 200 + i, 0.1f);
  auto grad = [&](size_t i, int64_t step) {
    return SpreadValues(params[i].total(), static_cast<uint32_t>(7000 * step + i), 1.0f);
  };
  auto config = [](const std::string& name) {
    OptimizerGroupConfig c = GroupConfig(name);
    c.moment_dtype = MomentDType::kBFloat16;  // 2-byte moments: pieces at odd offsets
    return c;
  };
  // The reference: unsharded on rank 0, never resharded.
  {
    std::vector<OptimizerParameterInit> inits;
    for (size_t i = 0; i < params.size(); ++i) {
      inits.push_back(WholeInit(params[i].name, params[i].shape, master[i], params[i].lr_scale));
    }
    QTX_ASSERT_OK(ranks.clients[0]->OffloadOptimizerState(config("ref"), inits).status());
  }
  OnEveryRank(rc.from, [&](int r) {
    std::vector<OptimizerParameterInit> inits;
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t b = from_cuts[i][r], e = from_cuts[i][r + 1];
      inits.push_back(
          ShardInit(params[i].name, params[i].shape, master[i], {b, e}, params[i].lr_scale));
    }
    auto info = ranks.clients[r]->OffloadOptimizerState(config("opt"), inits);
    ASSERT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
  });

  std::map<std::string, uint64_t> sequence;
  auto reference_step = [&](int64_t step) {
    std::vector<OptimizerGradient> g;
    for (size_t i = 0; i < params.size(); ++i) {
      g.push_back({params[i].name, Tensor::FromFloat32(params[i].shape, grad(i, step))});
    }
    StepOptions so;
    so.clip_factor = step % 2 == 0 ? std::optional<double>(0.5) : std::nullopt;
    auto ref = ranks.clients[0]->Step("ref", step, g, so);
    EXPECT_TRUE(ref.ok()) << ref.status();
    return ref.ok() ? *std::move(ref) : OptimizerStepResult{};
  };
  // Step `step` of the sharded group "opt" on `owners` owners at `cuts`
  // through `dp`, each owner's output against `ref`.
  auto sharded_step = [&](int64_t step, int owners, const Cuts& cuts, const std::string& dp,
                          const OptimizerStepResult& ref) {
    SCOPED_TRACE(absl::StrCat("step ", step, " on ", owners, " owners"));
    const uint64_t seq = sequence[dp]++;
    std::vector<absl::StatusOr<OptimizerStepResult>> out(owners);
    OnEveryRank(owners, [&](int r) {
      std::vector<OptimizerGradient> g;
      for (size_t i = 0; i < params.size(); ++i) {
        g.push_back({params[i].name, Slice(grad(i, step), cuts[i][r], cuts[i][r + 1])});
      }
      StepOptions so;
      so.clip_factor = step % 2 == 0 ? std::optional<double>(0.5) : std::nullopt;
      so.collective_group = dp;
      so.sequence = seq;
      out[r] = ranks.clients[r]->Step("opt", step, g, so, Deadline(kGroupTimeout));
    });
    for (int r = 0; r < owners; ++r) {
      ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status();
      ASSERT_EQ(out[r]->parameters.size(), params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        const int64_t b = cuts[i][r], e = cuts[i][r + 1];
        SCOPED_TRACE(
            absl::StrCat("rank ", r, " parameter ", params[i].name, " [", b, ", ", e, ")"));
        const ParameterOutput& o = out[r]->parameters[i];
        const ParameterOutput& want = ref.parameters[i];
        ASSERT_TRUE(o.fp8.has_value() && o.fp8->rowwise_data.has_value());
        EXPECT_TRUE(o.fp8->rowwise_data->data == want.fp8->rowwise_data->data.substr(b, e - b))
            << "FP8 bytes differ from the never-resharded group's";
        EXPECT_EQ(o.fp8->rowwise_scale_inv->data, want.fp8->rowwise_scale_inv->data);
        EXPECT_EQ(o.fp8->columnwise_scale_inv->data, want.fp8->columnwise_scale_inv->data);
        ASSERT_TRUE(o.bf16.has_value());
        EXPECT_TRUE(o.bf16->data == want.bf16->data.substr(2 * b, 2 * (e - b)));
      }
    }
  };
  auto save = [&](int owners, const std::string& group) {
    OnEveryRank(owners, [&](int r) {
      auto saved = ranks.clients[r]->SaveCheckpoint(group);
      EXPECT_TRUE(saved.ok()) << "rank " << r << ": " << saved.status();
    });
  };
  auto files = [&](int owners, const std::string& group) {
    std::vector<std::string> f;
    for (int r = 0; r < owners; ++r) {
      f.push_back(absl::StrCat(ranks.dir, "/rank", r, "/", group, ".qtxopt"));
    }
    return f;
  };
  auto shards_of = [&](const Cuts& cuts, int r) {
    std::vector<ParameterShard> s;
    for (size_t i = 0; i < params.size(); ++i) {
      s.push_back({params[i].name, ShardRange{cuts[i][r], cuts[i][r + 1]}});
    }
    return s;
  };

  // Two steps at the old size; every owner checkpoints step 2.
  ASSERT_NO_FATAL_FAILURE(sharded_step(1, rc.from, from_cuts, "dp_from", reference_step(1)));
  ASSERT_NO_FATAL_FAILURE(sharded_step(2, rc.from, from_cuts, "dp_from", reference_step(2)));
  save(rc.from, "opt");
  // Every new owner loads its ranges from every old owner's file.
  OnEveryRank(rc.to, [&](int r) {
    auto info =
        ranks.clients[r]->LoadResharded("opt", files(rc.from, "opt"), shards_of(to_cuts, r));
    ASSERT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
    EXPECT_EQ(info->step, 2);
    EXPECT_EQ(info->update_count, 2);
    EXPECT_EQ(info->last_checkpoint_step, -1);
    int64_t owned = 0;
    for (size_t i = 0; i < params.size(); ++i) owned += to_cuts[i][r + 1] - to_cuts[i][r];
    EXPECT_EQ(info->num_elements, owned);
    EXPECT_EQ(info->parameter_shards, shards_of(to_cuts, r));
  });
  // A retry of step 2 replays at the new ranges; then steps 3 and 4.
  ASSERT_NO_FATAL_FAILURE(sharded_step(2, rc.to, to_cuts, "dp_to", reference_step(2)));
  const OptimizerStepResult ref3 = reference_step(3);
  ASSERT_NO_FATAL_FAILURE(sharded_step(3, rc.to, to_cuts, "dp_to", ref3));
  ASSERT_NO_FATAL_FAILURE(sharded_step(4, rc.to, to_cuts, "dp_to", reference_step(4)));
  save(rc.to, "opt");

  // Sharded -> unsharded: rank 0 loads every parameter whole as "whole".
  auto whole = ranks.clients[0]->LoadResharded("whole", files(rc.to, "opt"), {});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(whole->parameter_shards.empty());
  {
    std::vector<OptimizerGradient> g;
    for (size_t i = 0; i < params.size(); ++i) {
      g.push_back({params[i].name, Tensor::FromFloat32(params[i].shape, grad(i, 5))});
    }
    auto out = ranks.clients[0]->Step("whole", 5, g);
    ASSERT_TRUE(out.ok()) << out.status();
    const OptimizerStepResult ref5 = reference_step(5);
    for (size_t i = 0; i < params.size(); ++i) {
      SCOPED_TRACE(params[i].name);
      const ParameterOutput& o = out->parameters[i];
      const ParameterOutput& want = ref5.parameters[i];
      EXPECT_TRUE(o.fp8->rowwise_data->data == want.fp8->rowwise_data->data);
      EXPECT_TRUE(o.fp8->columnwise_data->data == want.fp8->columnwise_data->data);
      EXPECT_EQ(o.fp8->rowwise_scale_inv->data, want.fp8->rowwise_scale_inv->data);
      EXPECT_TRUE(o.bf16->data == want.bf16->data);
    }
  }
  save(1, "whole");
  // Unsharded -> sharded: the old owners load their first ranges from the
  // one file (the group "opt" they hold is replaced).
  OnEveryRank(rc.from, [&](int r) {
    auto info = ranks.clients[r]->LoadResharded("opt", files(1, "whole"), shards_of(from_cuts, r));
    ASSERT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
    EXPECT_EQ(info->step, 5);
  });
  ASSERT_NO_FATAL_FAILURE(sharded_step(6, rc.from, from_cuts, "dp_from", reference_step(6)));

  // The masters and moments: each owner's slice of the reference's.
  GetStateOptions with_moments;
  with_moments.include_moments = true;
  auto ref_state = ranks.clients[0]->GetState("ref", with_moments);
  ASSERT_TRUE(ref_state.ok()) << ref_state.status();
  for (int r = 0; r < rc.from; ++r) {
    auto state = ranks.clients[r]->GetState("opt", with_moments);
    ASSERT_TRUE(state.ok()) << state.status();
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t b = from_cuts[i][r], e = from_cuts[i][r + 1];
      const OptimizerParameterState& got = state->parameters[i];
      const OptimizerParameterState& want = ref_state->parameters[i];
      EXPECT_TRUE(got.master.data == want.master.data.substr(4 * b, 4 * (e - b)));
      ASSERT_TRUE(got.exp_avg.has_value() && want.exp_avg.has_value());
      EXPECT_TRUE(got.exp_avg->data == want.exp_avg->data.substr(2 * b, 2 * (e - b)));
      EXPECT_TRUE(got.exp_avg_sq->data == want.exp_avg_sq->data.substr(2 * b, 2 * (e - b)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, ReshardE2eTest,
                         ::testing::Values(ReshardCase{2, 3}, ReshardCase{3, 2}),
                         [](const auto& info) {
                           return absl::StrCat(info.param.from, "to", info.param.to);
                         });

// Resharding errors: each names the problem, and the group loaded before
// stays as it was.
TEST(ReshardErrorsE2eTest, SourcesAreCheckedBeforeAnythingChanges) {
  const int world = 2;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  const std::vector<int64_t> shape = {200, 130};
  const int64_t total = 200 * 130;
  const std::vector<float> master = SpreadValues(total, 3, 0.1f);
  const std::vector<ShardRange> cuts = {{0, 12345}, {12345, total}};
  auto offload_sharded = [&](const std::string& name, double lr) {
    OnEveryRank(world, [&](int r) {
      OptimizerGroupConfig c = GroupConfig(name);
      c.hyper_params.lr = lr;
      auto info =
          ranks.clients[r]->OffloadOptimizerState(c, {ShardInit("w", shape, master, cuts[r])});
      ASSERT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
    });
  };
  uint64_t sequence = 0;
  auto step_all = [&](const std::string& name, int64_t step) {
    const uint64_t seq = sequence++;
    OnEveryRank(world, [&](int r) {
      StepOptions so;
      so.collective_group = "dp";
      so.sequence = seq;
      auto out =
          ranks.clients[r]->Step(name, step, {{"w", Slice(SpreadValues(total, 11, 1.0f), cuts[r])}},
                                 so, Deadline(kGroupTimeout));
      ASSERT_TRUE(out.ok()) << "rank " << r << ": " << out.status();
    });
  };
  auto file = [&](int r, const std::string& group) {
    return absl::StrCat(ranks.dir, "/rank", r, "/", group, ".qtxopt");
  };
  auto save = [&](int r, const std::string& group) {
    QTX_ASSERT_OK(ranks.clients[r]->SaveCheckpoint(group).status());
  };
  offload_sharded("opt", 1e-2);
  step_all("opt", 1);
  save(0, "opt");
  save(1, "opt");
  // "other": another lr; "ref": the same group unsharded, at the same step.
  offload_sharded("other", 2e-2);
  step_all("other", 1);
  save(0, "other");
  QTX_ASSERT_OK(ranks.clients[0]
                    ->OffloadOptimizerState(GroupConfig("ref"), {WholeInit("w", shape, master)})
                    .status());
  QTX_ASSERT_OK(
      ranks.clients[0]
          ->Step("ref", 1, {{"w", Tensor::FromFloat32(shape, SpreadValues(total, 11, 1.0f))}})
          .status());
  save(0, "ref");
  Client& c = *ranks.clients[0];
  const std::vector<ParameterShard> mine = {{"w", ShardRange{0, 100}}};
  using absl::StatusCode;
  // An old owner's file missing.
  EXPECT_THAT(c.LoadResharded("opt", {file(0, "opt")}, mine),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("parameter 'w': elements [12345, 26000) of its 26000 are in no "
                                 "source")));
  // A file named twice.
  EXPECT_THAT(c.LoadResharded("opt", {file(0, "opt"), file(0, "opt")}, mine),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("is named twice")));
  // Elements in two sources.
  EXPECT_THAT(c.LoadResharded("opt", {file(0, "opt"), file(1, "opt"), file(0, "ref")}, mine),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("parameter 'w': elements [0, 12345) are in two sources")));
  // Another group's file (another lr).
  EXPECT_THAT(c.LoadResharded("opt", {file(0, "other"), file(1, "opt")}, mine),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("are not checkpoints of one group: lr 0.02")));
  // Files of different steps: rank 1 checkpoints step 2.
  step_all("opt", 2);
  save(1, "opt");
  EXPECT_THAT(c.LoadResharded("opt", {file(0, "opt"), file(1, "opt")}, mine),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("written at different steps")));
  save(0, "opt");
  // New ranges: an unknown parameter, a range outside the parameter.
  EXPECT_THAT(
      c.LoadResharded("opt", {file(0, "opt"), file(1, "opt")}, {{"nope", ShardRange{0, 1}}}),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("'nope', which the sources do not hold (they hold: w)")));
  EXPECT_THAT(
      c.LoadResharded("opt", {file(0, "opt"), file(1, "opt")}, {{"w", ShardRange{10, total + 1}}}),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("0 <= begin <= end <= 26000")));
  // Paths: relative, not a checkpoint, outside the allowed directories,
  // missing.
  EXPECT_THAT(c.LoadResharded("opt", {"rank0/opt.qtxopt"}, mine),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("must be an absolute path")));
  EXPECT_THAT(c.LoadResharded("opt", {"/etc/passwd"}, mine),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a checkpoint file")));
  EXPECT_THAT(c.LoadResharded("opt", {"/tmp/opt.qtxopt"}, mine),
              StatusIs(StatusCode::kPermissionDenied, HasSubstr("--checkpoint_import_dirs")));
  EXPECT_THAT(c.LoadResharded("opt", {file(0, "missing")}, mine),
              StatusIs(StatusCode::kNotFound, HasSubstr("no checkpoint at")));
  // A corrupted source: one flipped byte in a part this sidecar would not
  // keep still fails the checksum.
  {
    const std::string bad = absl::StrCat(ranks.dir, "/rank1/bad.qtxopt");
    std::FILE* in = std::fopen(file(1, "opt").c_str(), "rb");
    ASSERT_NE(in, nullptr);
    std::string bytes;
    char buf[65536];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), in)) > 0;) bytes.append(buf, n);
    std::fclose(in);
    bytes[bytes.size() - 100] ^= 0x40;  // in the last moments: not within [0, 100)
    std::FILE* out = std::fopen(bad.c_str(), "wb");
    ASSERT_NE(out, nullptr);
    ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), out), bytes.size());
    std::fclose(out);
    EXPECT_THAT(c.LoadResharded("opt", {file(0, "opt"), bad}, mine),
                StatusIs(StatusCode::kDataLoss, HasSubstr("checksum mismatch")));
  }
  // Nothing changed: "opt" on rank 0 is as it was, at step 2, at its range.
  auto state = c.GetState("opt");
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->group.step, 2);
  ASSERT_EQ(state->group.parameter_shards.size(), 1u);
  EXPECT_EQ(state->group.parameter_shards[0].range, cuts[0]);
  EXPECT_EQ(state->group.last_checkpoint_step, 2);
  // And the good call works: rank 0 takes [0, 100).
  auto good = c.LoadResharded("opt", {file(0, "opt"), file(1, "opt")}, mine);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->num_elements, 100);
}

// Errors: every owner fails the same way, nothing changes.
TEST(ShardedStepErrorsE2eTest, RangesStepNumbersAndOptionsAreChecked) {
  const int world = 2;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  const std::vector<int64_t> shape = {200, 130};
  const int64_t total = 200 * 130;
  const std::vector<float> master = SpreadValues(total, 1, 0.1f);
  // Group `name` with rank r's range ranges[r].
  auto offload = [&](const std::string& name, const std::vector<ShardRange>& ranges) {
    OnEveryRank(world, [&](int r) {
      auto info = ranks.clients[r]->OffloadOptimizerState(
          GroupConfig(name), {ShardInit("w", shape, master, ranges[r])});
      ASSERT_TRUE(info.ok()) << "rank " << r << ": " << info.status();
    });
  };
  uint64_t sequence = 0;
  auto step_all = [&](const std::string& name, const std::vector<ShardRange>& ranges,
                      const std::function<int64_t(int)>& step_of,
                      const std::function<std::string(int)>& group_of) {
    const uint64_t seq = sequence++;
    std::vector<absl::StatusOr<OptimizerStepResult>> out(world);
    OnEveryRank(world, [&](int r) {
      StepOptions so;
      so.collective_group = "dp";
      so.sequence = seq;
      out[r] = ranks.clients[r]->Step(group_of(r), step_of(r),
                                      {{"w", Slice(SpreadValues(total, 9, 1.0f), ranges[r])}}, so,
                                      Deadline(kGroupTimeout));
    });
    (void)name;
    return out;
  };
  auto one = [](int) { return int64_t{1}; };

  // Overlapping ranges.
  const std::vector<ShardRange> overlap = {{0, 10000}, {9000, total}};
  offload("overlap", overlap);
  auto out = step_all("overlap", overlap, one, [](int) { return "overlap"; });
  for (int r = 0; r < world; ++r) {
    EXPECT_THAT(out[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("rank 0's shard [0, 10000) and rank 1's shard "
                                           "[9000, 26000) overlap")))
        << "rank " << r;
  }
  // A gap.
  const std::vector<ShardRange> gap = {{0, 10000}, {10100, total}};
  offload("gap", gap);
  out = step_all("gap", gap, one, [](int) { return "gap"; });
  for (int r = 0; r < world; ++r) {
    EXPECT_THAT(out[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("elements [10000, 10100) are owned by no rank")))
        << "rank " << r;
  }

  // A good group: a rank at a step number its group cannot take fails, and
  // so does the other, at once; nothing changes.
  const std::vector<ShardRange> good = {{0, 12345}, {12345, total}};
  offload("good", good);
  out = step_all(
      "good", good, [](int r) { return int64_t{r == 0 ? 1 : 2}; }, [](int) { return "good"; });
  for (int r = 0; r < world; ++r) {
    if (r == 1) {
      // Rank 1's own check fails first (group 'good' is at step 0).
      EXPECT_THAT(out[r], StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("step 0")));
    } else {
      EXPECT_THAT(out[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("rank 1 failed before the step")));
    }
  }
  // A rank that fails before the step (an unknown group): the other fails at
  // once, naming it.
  out = step_all("good", good, one, [](int r) { return r == 1 ? "nope" : "good"; });
  EXPECT_THAT(out[1], StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
  EXPECT_THAT(out[0], StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("rank 1 failed before the step")));
  // Nothing changed: step 1 still works on both.
  out = step_all("good", good, one, [](int) { return "good"; });
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status();
  // Rank 0 retries step 1 while rank 1 goes on to step 2: both are valid
  // alone, the agreement refuses them on both ranks.
  out = step_all(
      "good", good, [](int r) { return int64_t{r == 0 ? 1 : 2}; }, [](int) { return "good"; });
  for (int r = 0; r < world; ++r) {
    EXPECT_THAT(out[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("rank 0 steps to 1 but rank 1 to 2")))
        << "rank " << r;
  }

  // A sharded FP8 Step without a Collective group; options it refuses.
  const std::vector<OptimizerGradient> g0 = {{"w", Slice(SpreadValues(total, 9, 1.0f), 0, 12345)}};
  EXPECT_THAT(ranks.clients[0]->Step("good", 2, g0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("collective_group")));
  StepOptions clip;
  clip.max_grad_norm = 1.0;
  EXPECT_THAT(ranks.clients[0]->Step("good", 2, g0, clip),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data-parallel sharded")));
  // Statistics only: a local step is fine.
  StepOptions omit;
  omit.omit_parameters = true;
  QTX_EXPECT_OK(ranks.clients[0]->Step("good", 2, g0, omit).status());
  // A gradient of the wrong size.
  EXPECT_THAT(ranks.clients[0]->Step("good", 3, {{"w", Slice(master, 0, 100)}}, omit),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("12345 elements")));

  // Offload errors: a range outside the parameter, a master of the wrong
  // size, 1-D scaling for a sharded group.
  EXPECT_THAT(
      ranks.clients[0]->OffloadOptimizerState(GroupConfig("x"),
                                              {{.name = "w",
                                                .shape = shape,
                                                .master = Slice(master, 0, 10),
                                                .exp_avg = std::nullopt,
                                                .exp_avg_sq = std::nullopt,
                                                .shard = ShardRange{total - 5, total + 5}}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 <= begin <= end <= 26000")));
  EXPECT_THAT(
      ranks.clients[0]->OffloadOptimizerState(GroupConfig("x"), {{.name = "w",
                                                                  .shape = shape,
                                                                  .master = Slice(master, 0, 10),
                                                                  .exp_avg = std::nullopt,
                                                                  .exp_avg_sq = std::nullopt,
                                                                  .shard = ShardRange{0, 11}}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("11 elements")));
  OptimizerGroupConfig one_d = GroupConfig("x");
  one_d.output.fp8.scaling_mode = ScalingMode::kBlock1D;
  EXPECT_THAT(ranks.clients[0]->OffloadOptimizerState(one_d, {{.name = "w",
                                                               .shape = shape,
                                                               .master = Slice(master, 0, 10),
                                                               .exp_avg = std::nullopt,
                                                               .exp_avg_sq = std::nullopt,
                                                               .shard = ShardRange{0, 10}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("BLOCK_2D")));
  // collective_group on a group that is not sharded.
  QTX_ASSERT_OK(ranks.clients[0]
                    ->OffloadOptimizerState(GroupConfig("plain"), {WholeInit("w", shape, master)})
                    .status());
  const uint64_t seq = sequence++;
  std::vector<absl::StatusOr<OptimizerStepResult>> mixed(world);
  OnEveryRank(world, [&](int r) {
    StepOptions so;
    so.collective_group = "dp";
    so.sequence = seq;
    so.omit_parameters = true;
    if (r == 0) {
      const std::vector<OptimizerGradient> g = {{"w", Tensor::FromFloat32(shape, master)}};
      mixed[r] = ranks.clients[0]->Step("plain", 1, g, so, Deadline(kGroupTimeout));
    } else {
      const std::vector<OptimizerGradient> g = {{"w", Slice(master, 12345, total)}};
      mixed[r] = ranks.clients[1]->Step("good", 2, g, so, Deadline(kGroupTimeout));
    }
  });
  EXPECT_THAT(mixed[0],
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not data-parallel sharded")));
  EXPECT_THAT(mixed[1], StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("rank 0 failed before the step")));
}

}  // namespace
}  // namespace qtx::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::testing::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}

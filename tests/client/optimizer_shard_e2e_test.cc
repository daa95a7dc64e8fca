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
#include <cstdint>
#include <cstdlib>
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
#include "qtx/client.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;  // from --qtxd=

constexpr absl::Duration kGroupTimeout = absl::Seconds(20);

CallOptions Deadline(absl::Duration d) {
  CallOptions c;
  c.timeout = d;
  return c;
}

void OnEveryRank(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

struct Ranks {
  std::string dir;
  std::vector<std::unique_ptr<QtxdProcess>> servers;
  std::vector<std::unique_ptr<Client>> clients;
  int world() const { return static_cast<int>(clients.size()); }
};

void StartRanks(int world, Ranks* ranks) {
  char tmpl[] = "/tmp/qtx_shard_e2e.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  ranks->dir = tmpl;
  for (int r = 0; r < world; ++r) {
    auto server = QtxdProcess::Start(
        g_qtxd_path,
        {"--device=cpu", "--threads=2", absl::StrCat("--checkpoint_dir=", ranks->dir, "/rank", r)});
    ASSERT_TRUE(server.ok()) << "rank " << r << ": " << server.status();
    auto client = Client::Connect((*server)->target());
    ASSERT_TRUE(client.ok()) << client.status();
    ranks->servers.push_back(*std::move(server));
    ranks->clients.push_back(*std::move(client));
  }
  std::vector<absl::Status> st(world);
  OnEveryRank(world, [&](int r) {
    CollectiveGroupConfig config;
    config.name = "dp";
    config.rank = r;
    config.world_size = world;
    config.coordinator = r == 0 ? "" : ranks->servers[0]->target();
    config.backend = CommBackend::kGloo;
    config.timeout = kGroupTimeout;
    st[r] = ranks->clients[r]
                ->CreateGroup(config, Deadline(kGroupTimeout + absl::Seconds(10)))
                .status();
  });
  for (int r = 0; r < world; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
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

std::vector<float> Values(int64_t count, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    // Magnitudes that change along the flattened index, so that the owners
    // of a cut tile see different local amaxes.
    v[i] = d(rng) * scale * std::ldexp(1.0f, static_cast<int>((i / 911) % 9) - 4);
  }
  return v;
}

Tensor Slice(const std::vector<float>& full, int64_t begin, int64_t end) {
  return Tensor::FromFloat32({end - begin},
                             std::span<const float>(full).subspan(begin, end - begin));
}

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
  for (size_t i = 0; i < params.size(); ++i) master[i] = Values(params[i].total(), 100 + i, 0.1f);
  auto grad = [&](size_t i, int64_t step) {
    return Values(params[i].total(), static_cast<uint32_t>(1000 * step + i), 1.0f);
  };

  // The reference: the whole parameters, unsharded, on rank 0's sidecar.
  {
    std::vector<OptimizerParameterInit> inits;
    for (size_t i = 0; i < params.size(); ++i) {
      inits.push_back({.name = params[i].name,
                       .shape = params[i].shape,
                       .master = Tensor::FromFloat32(params[i].shape, master[i]),
                       .exp_avg = std::nullopt,
                       .exp_avg_sq = std::nullopt,
                       .lr_scale = params[i].lr_scale});
    }
    QTX_ASSERT_OK(ranks.clients[0]->OffloadOptimizerState(GroupConfig("ref"), inits).status());
  }
  // Every owner: the same parameters, its own slices.
  OnEveryRank(world, [&](int r) {
    std::vector<OptimizerParameterInit> inits;
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      inits.push_back({.name = p.name,
                       .shape = p.shape,
                       .master = Slice(master[i], p.cuts[r], p.cuts[r + 1]),
                       .exp_avg = std::nullopt,
                       .exp_avg_sq = std::nullopt,
                       .lr_scale = p.lr_scale,
                       .shard = ShardRange{p.cuts[r], p.cuts[r + 1]}});
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

// Errors: every owner fails the same way, nothing changes.
TEST(ShardedStepErrorsE2eTest, RangesStepNumbersAndOptionsAreChecked) {
  const int world = 2;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(StartRanks(world, &ranks));
  const std::vector<int64_t> shape = {200, 130};
  const int64_t total = 200 * 130;
  const std::vector<float> master = Values(total, 1, 0.1f);
  // Group `name` with rank r's range ranges[r].
  auto offload = [&](const std::string& name, const std::vector<ShardRange>& ranges) {
    OnEveryRank(world, [&](int r) {
      auto info = ranks.clients[r]->OffloadOptimizerState(
          GroupConfig(name), {{.name = "w",
                               .shape = shape,
                               .master = Slice(master, ranges[r].begin, ranges[r].end),
                               .exp_avg = std::nullopt,
                               .exp_avg_sq = std::nullopt,
                               .shard = ranges[r]}});
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
      out[r] = ranks.clients[r]->Step(
          group_of(r), step_of(r),
          {{"w", Slice(Values(total, 9, 1.0f), ranges[r].begin, ranges[r].end)}}, so,
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
  const std::vector<OptimizerGradient> g0 = {{"w", Slice(Values(total, 9, 1.0f), 0, 12345)}};
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
                    ->OffloadOptimizerState(GroupConfig("plain"),
                                            {{.name = "w",
                                              .shape = shape,
                                              .master = Tensor::FromFloat32(shape, master),
                                              .exp_avg = std::nullopt,
                                              .exp_avg_sq = std::nullopt}})
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
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}

// The AllGather op with real GlooCommunicators, ranks as threads of this
// process: bit identity with QuantizeBlock of the concatenation (1-D, 2-D and
// per-tensor scaling), and
// agreement / rejection errors reported on every rank.
#include "server/ops/allgather.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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
      for (auto scaling : {kernels::BlockScaling::kBlock1D, kernels::BlockScaling::kBlock2D,
                           kernels::BlockScaling::kTensor}) {
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

// TENSOR: a rank whose shard holds only small values still casts with the
// scale of the whole tensor's amax (held by the other rank), on the header
// path, the one-round path and GATHER_HIGH_PRECISION alike.
TEST_F(AllGatherOpTest, PerTensorScalingUsesTheWholeTensorsAmax) {
  Connect(2);
  std::vector<uint16_t> a(64 * 128, kernels::FloatToBf16(0.5f));
  std::vector<uint16_t> b(64 * 128, kernels::FloatToBf16(-200.0f));
  auto specs = std::vector<AllGatherRequestSpec>{Simple(0, 64, 128, a), Simple(0, 64, 128, b)};
  for (auto& s : specs) {
    s.params = {kernels::BlockScaling::kTensor, kernels::Fp8Format::kE4M3, true, true, true, 0.0f};
  }
  auto res = Run(specs);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(res[r].ok()) << res[r].status();
    const QuantizeResult& q = res[r]->result;
    float rs = 0, cs = 0;
    ASSERT_EQ(q.rowwise_scale_inv->inline_data.size(), 4u);
    EXPECT_EQ(q.rowwise_scale_inv->shape, std::vector<int64_t>{1});  // as Quantize's
    EXPECT_EQ(q.columnwise_scale_inv->shape, std::vector<int64_t>{1});
    EXPECT_EQ(q.columnwise_data->shape, (std::vector<int64_t>{128, 128}));
    std::memcpy(&rs, q.rowwise_scale_inv->inline_data.data(), 4);
    std::memcpy(&cs, q.columnwise_scale_inv->inline_data.data(), 4);
    EXPECT_EQ(rs, 0.5f);  // amax 200: power-of-two scale 2
    EXPECT_EQ(cs, 0.5f);
    // Rank 0's 0.5 * 2 = 1.0, not 0.5 * 512 (the scale of its own amax).
    EXPECT_EQ(static_cast<uint8_t>(q.rowwise_data->inline_data[0]), kernels::EncodeE4M3(1.0f));
    EXPECT_EQ(static_cast<uint8_t>(q.columnwise_data->inline_data[0]), kernels::EncodeE4M3(1.0f));
  }
  // One round (shard_rows): the same bytes, the amaxes gathered first.
  const std::string want[4] = {res[0]->result.rowwise_data->inline_data,
                               res[0]->result.rowwise_scale_inv->inline_data,
                               res[0]->result.columnwise_data->inline_data,
                               res[0]->result.columnwise_scale_inv->inline_data};
  for (auto& s : specs) {
    s.sequence = 1;
    s.shard_rows = {64, 64};
  }
  res = Run(specs);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(res[r].ok()) << res[r].status();
    EXPECT_TRUE(res[r]->one_round);
    const QuantizeResult& q = res[r]->result;
    EXPECT_EQ(q.rowwise_data->inline_data, want[0]);
    EXPECT_EQ(q.rowwise_scale_inv->inline_data, want[1]);
    EXPECT_EQ(q.columnwise_data->inline_data, want[2]);
    EXPECT_EQ(q.columnwise_scale_inv->inline_data, want[3]);
  }
  for (auto& s : specs) {
    s.sequence = 2;
    s.mode = AllGatherMode::kGatherHighPrecision;
  }
  res = Run(specs);
  for (auto& r : res) QTX_EXPECT_OK(r);
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

// ---- One round (AllGatherRequestSpec::shard_rows) ----

// Forwards to a real communicator and counts the collective calls of an op.
class CountingCommunicator final : public backend::Communicator {
 public:
  explicit CountingCommunicator(backend::Communicator* inner) : inner_(inner) {}
  std::string name() const override { return inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  tensor::MemoryKind memory_kind() const override { return inner_->memory_kind(); }
  absl::Status AllGatherV(const void* send, std::span<const uint64_t> recv_bytes, void* recv,
                          const backend::CommCall& call) override {
    ++calls;
    return inner_->AllGatherV(send, recv_bytes, recv, call);
  }
  absl::Status AllGatherVParts(std::span<const GatherPart> parts,
                               const backend::CommCall& call) override {
    ++calls;
    return inner_->AllGatherVParts(parts, call);
  }
  absl::Status AllGatherHost(const void* send, uint64_t bytes, void* recv,
                             const backend::CommCall& call,
                             const std::function<void()>& in_flight) override {
    ++calls;
    return inner_->AllGatherHost(send, bytes, recv, call, in_flight);
  }
  absl::Status AllReduceMax(float* data, uint64_t count, const backend::CommCall& call) override {
    ++calls;
    return inner_->AllReduceMax(data, count, call);
  }
  absl::Status Barrier(const backend::CommCall& call) override {
    ++calls;
    return inner_->Barrier(call);
  }
  void Abort() override { inner_->Abort(); }
  int calls = 0;

 private:
  backend::Communicator* inner_;
};

class OneRoundTest : public AllGatherOpTest {
 protected:
  struct Outcome {
    std::vector<absl::StatusOr<AllGatherResult>> res;
    std::vector<int> calls;
    std::vector<bool> broken;
  };
  Outcome RunCounted(std::vector<AllGatherRequestSpec> specs) {
    const int w = static_cast<int>(specs.size());
    Outcome o;
    o.res.assign(w, absl::UnknownError(""));
    o.calls.assign(w, 0);
    o.broken.assign(w, false);
    std::vector<std::thread> t;
    for (int r = 0; r < w; ++r) {
      t.emplace_back([&, r] {
        CountingCommunicator c(comms_[r].get());
        bool b = false;
        o.res[r] = AllGather(specs[r], ctx_, c, {absl::Now() + absl::Seconds(20)}, &b);
        o.broken[r] = b;
        o.calls[r] = c.calls;
      });
    }
    for (auto& th : t) th.join();
    return o;
  }
};

struct Concat {
  std::vector<int64_t> rows;
  int64_t n = 0, m = 0;
  std::vector<uint16_t> x;
};

Concat MakeConcat(const std::vector<int64_t>& rows, int64_t n) {
  Concat c{rows, n, 0, {}};
  for (int64_t r : rows) c.m += r;
  c.x.resize(c.m * n);
  std::mt19937 rng(static_cast<uint32_t>(c.m * 31 + n));
  std::normal_distribution<float> d(0, 1);
  int64_t row = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    // Very different magnitudes per rank: a block quantized from part of
    // its rows would get another scale.
    const float mag = std::ldexp(1.0f, static_cast<int>((r * 7) % 13) - 6);
    for (int64_t i = 0; i < rows[r] * n; ++i) c.x[row * n + i] = kernels::FloatToBf16(d(rng) * mag);
    row += rows[r];
  }
  return c;
}

std::vector<AllGatherRequestSpec> Specs(const Concat& c, uint64_t seq,
                                        const kernels::QuantizeParams& p, AllGatherMode mode,
                                        bool with_rows) {
  std::vector<AllGatherRequestSpec> specs(c.rows.size());
  int64_t row = 0;
  for (size_t r = 0; r < c.rows.size(); ++r) {
    specs[r] = Simple(seq, c.rows[r], c.n, c.x);
    specs[r].input.data = std::string_view(reinterpret_cast<const char*>(c.x.data() + row * c.n),
                                           c.rows[r] * c.n * 2);
    specs[r].params = p;
    specs[r].mode = mode;
    if (with_rows) specs[r].shard_rows = c.rows;
    row += c.rows[r];
  }
  return specs;
}

std::string Bytes(const std::optional<OutputTensor>& t) {
  return t.has_value() ? t->inline_data : std::string("<none>");
}

// The acceptance suite of the one-round path: for 1 to 5 ranks and
// every shard pattern of the other suites plus shards smaller than one block
// in the middle of the group, 1-D and 2-D, rowwise, columnwise and both, both
// modes: the one-round result equals the header-exchange path's and
// QuantizeBlock of the concatenation, byte for byte, on every rank, and the
// one-round call made exactly one collective call.
TEST_F(OneRoundTest, BitIdenticalToBothOtherPathsOnEveryShardPattern) {
  const std::vector<std::pair<int, std::vector<std::vector<int64_t>>>> worlds = {
      {1, {{0}, {5}, {300}}},
      {2, {{64, 64}, {0, 300}, {128, 128}, {300, 0}, {5, 300}}},
      {3, {{100, 156, 1}, {0, 300, 0}, {129, 127, 256}, {200, 3, 300}, {250, 5, 250}}},
      {4, {{250, 250, 250, 250}, {1, 1, 1, 1}, {128, 5, 123, 128}}},
      {5,
       {{250, 1, 2, 5, 300},
        {128, 5, 123, 0, 128},
        {10, 20, 30, 40, 50},
        {0, 0, 0, 0, 0},
        {300, 100, 3, 0, 129}}}};
  const struct { bool row, col; } copies[] = {{true, false}, {false, true}, {true, true}};
  for (const auto& [world, grids] : worlds) {
    Connect(world);
    uint64_t seq = 0;
    for (const auto& rows : grids) {
      for (int64_t n : {1, 100, 300}) {
        const Concat c = MakeConcat(rows, n);
        for (auto scaling : {kernels::BlockScaling::kBlock1D, kernels::BlockScaling::kBlock2D,
                             kernels::BlockScaling::kTensor}) {
          for (const auto& cp : copies) {
            const kernels::QuantizeParams p{
                scaling, kernels::Fp8Format::kE4M3, cp.row, cp.col, true, 0.0f};
            const auto l = kernels::ComputeLayout(scaling, c.m, n);
            std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
            std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
            kernels::cpu::QuantizeBlock(c.x.data(), kernels::InputDType::kBFloat16, c.m, n, p,
                                        {rd.data(), rs.data(), cd.data(), cs.data()});
            const std::string ref[4] = {
                cp.row ? std::string(reinterpret_cast<const char*>(rd.data()), rd.size())
                       : "<none>",
                cp.row ? std::string(reinterpret_cast<const char*>(rs.data()), rs.size() * 4)
                       : "<none>",
                cp.col ? std::string(reinterpret_cast<const char*>(cd.data()), cd.size())
                       : "<none>",
                cp.col ? std::string(reinterpret_cast<const char*>(cs.data()), cs.size() * 4)
                       : "<none>"};
            for (auto mode : {AllGatherMode::kExactFp8, AllGatherMode::kGatherHighPrecision}) {
              SCOPED_TRACE(absl::StrFormat("world=%d rows=%s n=%d %s row=%d col=%d %s", world,
                                           absl::StrJoin(rows, ","), n, ScalingName(scaling),
                                           cp.row, cp.col, AllGatherModeName(mode)));
              Outcome header_path = RunCounted(Specs(c, seq++, p, mode, false));
              Outcome one = RunCounted(Specs(c, seq++, p, mode, true));
              // TENSOR's one round has one more collective first: the
              // shard amaxes.
              const int one_round_calls =
                  scaling == kernels::BlockScaling::kTensor && mode == AllGatherMode::kExactFp8 ? 2
                                                                                                : 1;
              for (int r = 0; r < world; ++r) {
                ASSERT_TRUE(header_path.res[r].ok()) << header_path.res[r].status();
                ASSERT_TRUE(one.res[r].ok()) << "rank " << r << ": " << one.res[r].status();
                EXPECT_TRUE(one.res[r]->one_round);
                EXPECT_FALSE(header_path.res[r]->one_round);
                EXPECT_EQ(one.calls[r], one_round_calls)
                    << "the one-round path made more collective calls than planned";
                EXPECT_GT(header_path.calls[r], 1);
                EXPECT_EQ(one.res[r]->shard_rows, rows);
                const QuantizeResult& q = one.res[r]->result;
                const QuantizeResult& h = header_path.res[r]->result;
                EXPECT_EQ(q.shape, (std::vector<int64_t>{c.m, n}));
                const std::string got[4] = {Bytes(q.rowwise_data), Bytes(q.rowwise_scale_inv),
                                            Bytes(q.columnwise_data),
                                            Bytes(q.columnwise_scale_inv)};
                const std::string old[4] = {Bytes(h.rowwise_data), Bytes(h.rowwise_scale_inv),
                                            Bytes(h.columnwise_data),
                                            Bytes(h.columnwise_scale_inv)};
                for (int i = 0; i < 4; ++i) {
                  EXPECT_EQ(got[i], ref[i]) << "output " << i << " differs from the reference";
                  EXPECT_EQ(got[i], old[i]) << "output " << i << " differs from the header path";
                }
              }
            }
          }
        }
      }
    }
  }
}

// Mismatches: every rank fails with the same message naming the field and
// the rank, in one collective call, and the group stays usable.
TEST_F(OneRoundTest, DisagreementFailsEveryRankNamingFieldAndRank) {
  Connect(3);
  // Rank 0's 256 rows make the largest slot whatever the other entries, so
  // lists that differ elsewhere still give equal slot sizes.
  const Concat c = MakeConcat({256, 28, 100}, 128);
  const kernels::QuantizeParams p{
      kernels::BlockScaling::kBlock1D, kernels::Fp8Format::kE4M3, true, true, true, 0.0f};
  uint64_t seq = 0;
  auto expect_all = [](const Outcome& o, absl::StatusCode code, const std::string& what) {
    for (size_t r = 0; r < o.res.size(); ++r) {
      EXPECT_THAT(o.res[r], StatusIs(code, HasSubstr(what))) << "rank " << r;
      EXPECT_EQ(o.calls[r], 1);
    }
  };
  {
    // A different list on rank 1 (its own entry is right) with the same
    // slot size: the digest catches it.
    auto specs = Specs(c, seq, p, AllGatherMode::kExactFp8, true);
    specs[1].shard_rows = {256, 28, 90};
    Outcome o = RunCounted(specs);
    expect_all(o, absl::StatusCode::kInvalidArgument,
               "ranks disagree on shard_rows: rank 0 and rank 1 passed different lists");
    for (bool b : o.broken) EXPECT_FALSE(b);
    ++seq;
  }
  {
    auto specs = Specs(c, seq, p, AllGatherMode::kExactFp8, true);
    specs[2].sequence = seq + 7;
    Outcome o = RunCounted(specs);
    expect_all(
        o, absl::StatusCode::kInvalidArgument,
        absl::StrFormat("ranks disagree on sequence: rank 0 has %d, rank 2 has %d", seq, seq + 7));
    ++seq;
  }
  {
    auto specs = Specs(c, seq, p, AllGatherMode::kExactFp8, true);
    specs[1].params.amax_epsilon = 1e-3f;
    specs[2].params.format = kernels::Fp8Format::kE5M2;
    Outcome o = RunCounted(specs);
    // The first rank that differs from rank 0, and its first field.
    expect_all(o, absl::StatusCode::kInvalidArgument,
               "ranks disagree on config.amax_epsilon: rank 0 has 0, rank 1 has 0.001");
    ++seq;
  }
  {
    // shard_rows[1] contradicts rank 1's input: rank 1 says so, the others
    // name rank 1.
    auto specs = Specs(c, seq, p, AllGatherMode::kExactFp8, true);
    for (auto& s : specs) s.shard_rows = {256, 30, 100};
    Outcome o = RunCounted(specs);
    EXPECT_THAT(o.res[1], StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("shard_rows[1]=30 but this rank's input has 28")));
    for (int r : {0, 2}) {
      EXPECT_THAT(o.res[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("rank 1 rejected its request: shard_rows[1]=30")));
    }
    ++seq;
  }
  {
    // A bad request (an unknown output region) on one rank fails all ranks.
    auto specs = Specs(c, seq, p, AllGatherMode::kExactFp8, true);
    specs[2].outputs.columnwise_data = tensor::RegionSliceSpec{"no_such_region", 0, 384 * 128};
    Outcome o = RunCounted(specs);
    EXPECT_THAT(o.res[2], StatusIs(absl::StatusCode::kNotFound, HasSubstr("no_such_region")));
    for (int r : {0, 1}) {
      EXPECT_THAT(o.res[r],
                  StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank 2 rejected its request")));
    }
    ++seq;
  }
  {
    // Wrong length on every rank: rejected locally by each, reported by all.
    auto specs = Specs(c, seq, p, AllGatherMode::kExactFp8, true);
    for (auto& s : specs) s.shard_rows = {256, 28};
    Outcome o = RunCounted(specs);
    for (int r = 0; r < 3; ++r) {
      EXPECT_THAT(o.res[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("shard_rows has 2 entries: the group has 3")));
    }
    ++seq;
  }
  // After all of that the group still works, in one round.
  Outcome o = RunCounted(Specs(c, seq, p, AllGatherMode::kExactFp8, true));
  for (int r = 0; r < 3; ++r) {
    QTX_ASSERT_OK(o.res[r]);
    EXPECT_EQ(o.calls[r], 1);
  }
}

// Ranks that compute different payload sizes never report an output as
// valid and never take the process down (Gloo's transport would, for a
// message longer than the receive posted: gloo_communicator.h): one rank
// without shard_rows (it runs the header exchange), then a config that
// changes the payload size. Every rank fails with
// INVALID_ARGUMENT, and the group stays usable.
TEST_F(OneRoundTest, DifferentPayloadSizesFailEveryRankAndKeepTheGroup) {
  Connect(2);
  const Concat c = MakeConcat({100, 300}, 128);
  const kernels::QuantizeParams p{
      kernels::BlockScaling::kBlock2D, kernels::Fp8Format::kE4M3, true, true, true, 0.0f};
  uint64_t seq = 0;
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE(variant);
    auto specs = Specs(c, seq++, p, AllGatherMode::kExactFp8, true);
    if (variant == 0) specs[1].shard_rows.clear();
    if (variant == 1) specs[0].shard_rows.clear();
    if (variant == 2) specs[1].params.columnwise = false;  // one FP8 copy: a smaller slot
    // TENSOR on one rank: its first collective (the shard amaxes) meets the
    // other rank's slots.
    if (variant == 3) specs[0].params.scaling = kernels::BlockScaling::kTensor;
    Outcome o = RunCounted(specs);
    for (int r = 0; r < 2; ++r) {
      EXPECT_THAT(o.res[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("the ranks passed different sizes")))
          << "rank " << r;
      EXPECT_THAT(o.res[r], StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("pass shard_rows on every rank")));
      EXPECT_FALSE(o.broken[r]);
    }
  }
  Outcome o = RunCounted(Specs(c, seq, p, AllGatherMode::kExactFp8, true));
  for (int r = 0; r < 2; ++r) QTX_EXPECT_OK(o.res[r]);
}

}  // namespace
}  // namespace qtx::server::ops

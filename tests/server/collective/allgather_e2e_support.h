// What the multi-process AllGather tests of the server share (Gloo:
// collective_e2e_test, NCCL: nccl_e2e_test, both driving qtxd through the
// generated Collective stubs): a BF16 [M, N] input split into per-rank row
// shards, one AllGather request per rank, and the calls made concurrently.
// Header only; the tests link gRPC, the protos and qtx_kernels_cpu.
#ifndef QTX_TESTS_SERVER_COLLECTIVE_ALLGATHER_E2E_SUPPORT_H_
#define QTX_TESTS_SERVER_COLLECTIVE_ALLGATHER_E2E_SUPPORT_H_

#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/fp8.h"
#include "qtx/v1/collective.grpc.pb.h"

namespace qtx::testing {

// Rank r's shard is rows[r] rows of the [m, n] concatenation x.
struct Shards {
  std::vector<int64_t> rows;
  int64_t n = 0;
  int64_t m = 0;
  std::vector<uint16_t> x;  // the concatenation, BF16
};

// Normal values (seeded by m and n) with a different magnitude per rank, so
// that blocks straddling two ranks take their max from the other rank.
inline Shards MakeShards(std::vector<int64_t> rows, int64_t n) {
  Shards s;
  s.rows = std::move(rows);
  s.n = n;
  for (int64_t r : s.rows) s.m += r;
  s.x.resize(s.m * n);
  std::mt19937 rng(static_cast<uint32_t>(s.m * 131 + n));
  std::normal_distribution<float> d(0, 1);
  int64_t row = 0;
  for (size_t r = 0; r < s.rows.size(); ++r) {
    const float mag = std::ldexp(1.0f, static_cast<int>((r * 7) % 13) - 6);
    for (int64_t i = 0; i < s.rows[r] * n; ++i) {
      s.x[row * n + i] = kernels::FloatToBf16(d(rng) * mag);
    }
    row += s.rows[r];
  }
  return s;
}

// Rank `rank`'s AllGather of its shard, inline, rowwise (+ columnwise).
inline v1::AllGatherRequest Request(const std::string& group, uint64_t seq, const Shards& s,
                                    int rank, v1::AllGatherMode mode, v1::ScalingMode scaling,
                                    bool columnwise = true) {
  v1::AllGatherRequest req;
  req.set_group(group);
  req.set_sequence(seq);
  int64_t off = 0;
  for (int r = 0; r < rank; ++r) off += s.rows[r];
  auto* in = req.mutable_input();
  in->set_dtype(v1::BFLOAT16);
  in->add_shape(s.rows[rank]);
  in->add_shape(s.n);
  in->set_inline_data(
      std::string(reinterpret_cast<const char*>(s.x.data() + off * s.n), s.rows[rank] * s.n * 2));
  req.mutable_config()->set_scaling_mode(scaling);
  req.mutable_config()->set_rowwise(true);
  req.mutable_config()->set_columnwise(columnwise);
  req.set_mode(mode);
  return req;
}

// reqs[r] on c.sidecars[r].stub (a v1::Collective stub), one thread per rank
// except skip_rank, each with `deadline`; the statuses by rank (OK for the
// skipped one), the responses in *resps.
template <typename Cluster>
std::vector<grpc::Status> RunAllGather(Cluster& c, const std::vector<v1::AllGatherRequest>& reqs,
                                       std::vector<v1::AllGatherResponse>* resps,
                                       absl::Duration deadline, int skip_rank = -1) {
  const int w = static_cast<int>(reqs.size());
  std::vector<grpc::Status> out(w);
  resps->assign(w, {});
  std::vector<std::thread> t;
  for (int r = 0; r < w; ++r) {
    if (r == skip_rank) continue;
    t.emplace_back([&, r] {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
      out[r] = c.sidecars[r].stub->AllGather(&ctx, reqs[r], &(*resps)[r]);
    });
  }
  for (auto& th : t) th.join();
  return out;
}

inline std::string Bytes(const void* p, size_t n) {
  return std::string(static_cast<const char*>(p), n);
}

}  // namespace qtx::testing

#endif  // QTX_TESTS_SERVER_COLLECTIVE_ALLGATHER_E2E_SUPPORT_H_

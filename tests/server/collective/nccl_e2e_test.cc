// Two qtxd processes, one per GPU (--device=cuda:0, cuda:1), in an NCCL
// group: AllGather is byte-identical to kernels::cpu::QuantizeBlock of the
// concatenation (both modes, 1-D and 2-D, rowwise+columnwise and
// rowwise-only), and a rank that never calls makes the other fail with
// DEADLINE_EXCEEDED within the deadline, its group BROKEN (the NCCL
// communicator aborted), after which a new group works; with the shard and
// the outputs in CUDA IPC regions (the early path: rowwise 1-D quantized
// before the header exchange) and interprocess events ordering the call
// after the client's stream, the bytes are the same. Label gpu: needs two
// CUDA devices and libnccl on the library path.
#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
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
#include "qtx/cuda_ipc.h"
#include "qtx/v1/collective.grpc.pb.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "tests/server/collective/allgather_e2e_support.h"
#include "tests/testing/qtxd_process.h"

#ifndef QTXD_PATH
#error "QTXD_PATH must name the qtxd binary"
#endif

namespace qtx {
namespace {

using ::qtx::testing::Bytes;
using ::qtx::testing::MakeShards;
using ::qtx::testing::QtxdPath;
using ::qtx::testing::QtxdProcess;
using ::qtx::testing::Request;
using ::qtx::testing::RunAllGather;
using ::qtx::testing::Shards;
using ::testing::HasSubstr;

constexpr int kWorld = 2;
constexpr int kMaxMessageMb = 256;

struct Sidecar {
  std::unique_ptr<QtxdProcess> process;  // null if it did not start
  int port = 0;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Collective::Stub> stub;
  std::unique_ptr<v1::Memory::Stub> memory;
};

// qtxd on cuda:0 and cuda:1 (QtxdProcess). QTXD may override the binary (a bundle's launcher).
class GpuPair {
 public:
  GpuPair() {
    for (int i = 0; i < kWorld; ++i) {
      Sidecar s;
      QtxdProcess::Options options;
      options.timeout = absl::Seconds(60);
      absl::StatusOr<std::unique_ptr<QtxdProcess>> process = QtxdProcess::StartOnLoopbackPort(
          QtxdPath(),
          {absl::StrCat("--device=cuda:", i), absl::StrCat("--max_message_mb=", kMaxMessageMb),
           "--threads=2"},
          options, &s.port);
      // A rank that did not start fails the test; its calls fail (UNAVAILABLE).
      EXPECT_TRUE(process.ok()) << "qtxd on cuda:" << i << " did not start: " << process.status();
      std::string target = "unix:/nonexistent/qtxd.sock";
      if (process.ok()) {
        s.process = *std::move(process);
        target = s.process->target();
      }
      grpc::ChannelArguments ch;
      ch.SetMaxReceiveMessageSize(kMaxMessageMb << 20);
      ch.SetMaxSendMessageSize(kMaxMessageMb << 20);
      s.channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), ch);
      s.stub = v1::Collective::NewStub(s.channel);
      s.memory = v1::Memory::NewStub(s.channel);
      sidecars.push_back(std::move(s));
    }
  }
  // kill -9 of both ranks (no clean shutdown to wait for).
  ~GpuPair() {
    for (auto& s : sidecars) {
      if (s.process != nullptr) s.process->Kill();
    }
  }
  std::string Coordinator() const { return absl::StrCat("127.0.0.1:", sidecars[0].port); }

  std::vector<grpc::Status> Create(const std::string& name, v1::CommBackend backend) {
    std::vector<grpc::Status> out(kWorld);
    std::vector<std::thread> t;
    for (int r = 0; r < kWorld; ++r) {
      t.emplace_back([&, r] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(90));
        v1::CreateGroupRequest req;
        req.set_name(name);
        req.set_rank(r);
        req.set_world_size(kWorld);
        req.set_coordinator(r == 0 ? "" : Coordinator());
        req.set_timeout_ms(60000);
        req.set_backend(backend);
        v1::CreateGroupResponse resp;
        out[r] = sidecars[r].stub->CreateGroup(&ctx, req, &resp);
        if (out[r].ok()) {
          EXPECT_EQ(resp.group().backend(), v1::NCCL) << "rank " << r;
        }
      });
    }
    for (auto& th : t) th.join();
    return out;
  }
  void Destroy(const std::string& name) {
    for (auto& s : sidecars) {
      grpc::ClientContext ctx;
      v1::DestroyGroupRequest req;
      req.set_name(name);
      v1::DestroyGroupResponse resp;
      (void)s.stub->DestroyGroup(&ctx, req, &resp);
    }
  }
  v1::GroupInfo Info(int rank, const std::string& name) {
    grpc::ClientContext ctx;
    v1::ListGroupsRequest req;
    v1::ListGroupsResponse resp;
    EXPECT_TRUE(sidecars[rank].stub->ListGroups(&ctx, req, &resp).ok());
    for (const auto& g : resp.groups()) {
      if (g.name() == name) return g;
    }
    return {};
  }

  std::vector<Sidecar> sidecars;
};

#define ASSERT_CUDA(expr)                                                  \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

// Every test needs kWorld GPUs: on fewer it fails at once, saying so (not
// after the ranks' start-up and collective deadlines).
class NcclE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    ASSERT_CUDA(cudaGetDeviceCount(&devices));
    ASSERT_GE(devices, kWorld) << "NcclE2E needs " << kWorld
                               << " CUDA devices (one qtxd per GPU: NCCL refuses two ranks "
                                  "on one device)";
  }
};

TEST_F(NcclE2E, AllGatherIsBitIdenticalToQuantizeOfConcatenation) {
  GpuPair c;
  // Unspecified backend on a CUDA device means NCCL (checked in Create).
  for (const auto& s : c.Create("nccl", v1::COMM_BACKEND_UNSPECIFIED)) {
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const std::vector<std::vector<int64_t>> grids = {{64, 64},   {0, 300},   {300, 0}, {128, 128},
                                                   {100, 156}, {129, 127}, {1, 255}, {4095, 4097}};
  uint64_t seq = 0;
  int checked = 0;
  for (const auto& rows : grids) {
    for (int64_t n : {1, 100, 128, 300}) {
      const Shards sh = MakeShards(rows, n);
      for (auto scaling : {v1::BLOCK_1D, v1::BLOCK_2D, v1::TENSOR}) {
        const auto ks = scaling == v1::BLOCK_1D   ? kernels::BlockScaling::kBlock1D
                        : scaling == v1::BLOCK_2D ? kernels::BlockScaling::kBlock2D
                                                  : kernels::BlockScaling::kTensor;
        for (bool columnwise : {true, false}) {
          const kernels::QuantizeParams p{ks,  kernels::Fp8Format::kE4M3, true, columnwise, true,
                                          0.0f};
          const auto l = kernels::ComputeLayout(ks, sh.m, n);
          std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
          std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
          kernels::cpu::QuantizeBlock(sh.x.data(), kernels::InputDType::kBFloat16, sh.m, n, p,
                                      {rd.data(), rs.data(), cd.data(), cs.data()});
          // one_round: the request carries shard_rows (one ncclAllGather).
          for (int variant = 0; variant < 4; ++variant) {
            const auto mode = variant % 2 == 0 ? v1::EXACT_FP8 : v1::GATHER_HIGH_PRECISION;
            const bool one_round = variant >= 2;
            SCOPED_TRACE(
                absl::StrFormat("rows=%d+%d n=%d scaling=%d columnwise=%d mode=%d one_round=%d",
                                rows[0], rows[1], n, scaling, columnwise, mode, one_round));
            std::vector<v1::AllGatherRequest> reqs;
            for (int r = 0; r < kWorld; ++r) {
              reqs.push_back(Request("nccl", seq, sh, r, mode, scaling, columnwise));
              if (one_round) {
                for (int64_t m : rows) reqs.back().add_shard_rows(m);
              }
            }
            ++seq;
            std::vector<v1::AllGatherResponse> resps;
            auto st = RunAllGather(c, reqs, &resps, absl::Seconds(60));
            for (int r = 0; r < kWorld; ++r) {
              ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
              const auto& q = resps[r].result();
              ASSERT_EQ(q.rowwise_data().inline_data(), Bytes(rd.data(), rd.size()));
              ASSERT_EQ(q.rowwise_scale_inv().inline_data(), Bytes(rs.data(), rs.size() * 4));
              if (columnwise) {
                ASSERT_EQ(q.columnwise_data().inline_data(), Bytes(cd.data(), cd.size()));
                ASSERT_EQ(q.columnwise_scale_inv().inline_data(), Bytes(cs.data(), cs.size() * 4));
              } else {
                EXPECT_FALSE(q.has_columnwise_data());
              }
              EXPECT_THAT(resps[r].shard_rows(), ::testing::ElementsAreArray(rows));
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 8 * 4 * 3 * 2 * 4);
  EXPECT_EQ(c.Info(0, "nccl").state(), v1::READY);
}

TEST_F(NcclE2E, MissingRankFailsWithinDeadlineAndNewGroupWorks) {
  GpuPair c;
  for (const auto& s : c.Create("f", v1::NCCL)) ASSERT_TRUE(s.ok()) << s.error_message();
  const Shards a = MakeShards({4095, 4097}, 300);
  std::vector<v1::AllGatherRequest> reqs;
  for (int r = 0; r < kWorld; ++r) {
    reqs.push_back(Request("f", 0, a, r, v1::EXACT_FP8, v1::BLOCK_1D, true));
  }
  std::vector<v1::AllGatherResponse> resps;
  const absl::Time start = absl::Now();
  auto st = RunAllGather(c, reqs, &resps, absl::Seconds(3), /*skip_rank=*/1);
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Seconds(3) + absl::Milliseconds(500));
  EXPECT_EQ(st[0].error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st[0].error_message();
  EXPECT_THAT(st[0].error_message(), HasSubstr("aborted"));
  const v1::GroupInfo info = c.Info(0, "f");
  EXPECT_EQ(info.state(), v1::BROKEN) << info.error();
  c.Destroy("f");

  for (const auto& s : c.Create("g", v1::NCCL)) ASSERT_TRUE(s.ok()) << s.error_message();
  const Shards b = MakeShards({10, 300}, 128);
  const kernels::QuantizeParams p{
      kernels::BlockScaling::kBlock2D, kernels::Fp8Format::kE4M3, true, true, true, 0.0f};
  const auto l = kernels::ComputeLayout(p.scaling, b.m, b.n);
  std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  kernels::cpu::QuantizeBlock(b.x.data(), kernels::InputDType::kBFloat16, b.m, b.n, p,
                              {rd.data(), rs.data(), cd.data(), cs.data()});
  reqs.clear();
  for (int r = 0; r < kWorld; ++r) {
    reqs.push_back(Request("g", 0, b, r, v1::EXACT_FP8, v1::BLOCK_2D, true));
  }
  st = RunAllGather(c, reqs, &resps, absl::Seconds(30));
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
    EXPECT_EQ(resps[r].result().rowwise_data().inline_data(), Bytes(rd.data(), rd.size()));
    EXPECT_EQ(resps[r].result().columnwise_data().inline_data(), Bytes(cd.data(), cd.size()));
  }
}

// One rank's device memory, registered with its sidecar as a CUDA IPC
// region: [input | rowwise data | rowwise scales | columnwise data |
// columnwise scales], each part 256-byte aligned.
struct RankBuffers {
  void* base = nullptr;
  uint64_t bytes = 0;
  uint64_t off[5] = {};
  ~RankBuffers() {
    if (base != nullptr) (void)cudaFree(base);
  }
};

uint64_t Align256(uint64_t x) { return (x + 255) / 256 * 256; }

v1::RegionSlice Slice(const std::string& region, uint64_t offset, uint64_t size) {
  v1::RegionSlice s;
  s.set_region(region);
  s.set_offset(offset);
  s.set_size(size);
  return s;
}

// Blocks the client's stream for a while, so that a sidecar that did not
// wait for the client's event would read the stale shard.
void CUDART_CB SleepOnStream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(60)); }

TEST_F(NcclE2E, CudaIpcRegionsAndEventsGiveTheSameBytes) {
  GpuPair c;
  for (const auto& s : c.Create("ipc", v1::NCCL)) ASSERT_TRUE(s.ok()) << s.error_message();
  // Enough room for the largest case below: 8192 x 300 gathered.
  constexpr int64_t kMaxM = 8192, kMaxN = 300;
  const auto lmax = kernels::ComputeLayout(kernels::BlockScaling::kBlock1D, kMaxM, kMaxN);
  RankBuffers bufs[kWorld];
  cudaStream_t streams[kWorld];
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_CUDA(cudaSetDevice(r));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    RankBuffers& b = bufs[r];
    const uint64_t parts[5] = {static_cast<uint64_t>(kMaxM * kMaxN * 2),
                               static_cast<uint64_t>(lmax.RowwiseDataBytes()),
                               4 * static_cast<uint64_t>(lmax.RowwiseScaleCount()) + 4096,
                               static_cast<uint64_t>(lmax.ColumnwiseDataBytes()),
                               4 * static_cast<uint64_t>(lmax.ColumnwiseScaleCount()) + 4096};
    for (int i = 0; i < 5; ++i) {
      b.off[i] = b.bytes;
      b.bytes += Align256(parts[i]);
    }
    ASSERT_CUDA(cudaMalloc(&b.base, b.bytes));
    absl::StatusOr<std::string> handle = qtx::cuda::ExportMemHandle(b.base);
    ASSERT_TRUE(handle.ok()) << handle.status();
    grpc::ClientContext ctx;
    v1::RegisterRegionRequest req;
    req.set_name("buf");
    req.mutable_cuda_ipc()->set_ipc_handle(*handle);
    req.mutable_cuda_ipc()->set_device_id(r);
    req.mutable_cuda_ipc()->set_byte_size(b.bytes);
    v1::RegisterRegionResponse resp;
    const grpc::Status st = c.sidecars[r].memory->RegisterRegion(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
  }
  struct Case {
    std::vector<int64_t> rows;
    int64_t n;
    v1::ScalingMode scaling;
    bool columnwise;
    v1::AllGatherMode mode;
  };
  const Case cases[] = {
      // EXACT_FP8 rowwise-only 1-D: quantized before the header exchange.
      {{4095, 4097}, 128, v1::BLOCK_1D, false, v1::EXACT_FP8},
      {{100, 156}, 300, v1::BLOCK_1D, false, v1::EXACT_FP8},
      {{128, 128}, 128, v1::BLOCK_1D, false, v1::EXACT_FP8},
      // The other early-path combinations (no early quantize).
      {{129, 127}, 300, v1::BLOCK_1D, true, v1::EXACT_FP8},
      {{4095, 4097}, 300, v1::BLOCK_2D, true, v1::EXACT_FP8},
      {{1, 255}, 128, v1::BLOCK_2D, false, v1::GATHER_HIGH_PRECISION},
      {{300, 200}, 100, v1::BLOCK_1D, true, v1::GATHER_HIGH_PRECISION},
      // Per-tensor scaling: the shard amaxes reduced on the device.
      {{4095, 4097}, 300, v1::TENSOR, true, v1::EXACT_FP8},
      {{129, 127}, 128, v1::TENSOR, false, v1::EXACT_FP8},
  };
  uint64_t seq = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(absl::StrFormat("rows=%d+%d n=%d scaling=%d columnwise=%d mode=%d", k.rows[0],
                                 k.rows[1], k.n, k.scaling, k.columnwise, k.mode));
    const Shards sh = MakeShards(k.rows, k.n);
    const auto ks = k.scaling == v1::BLOCK_1D   ? kernels::BlockScaling::kBlock1D
                    : k.scaling == v1::BLOCK_2D ? kernels::BlockScaling::kBlock2D
                                                : kernels::BlockScaling::kTensor;
    const kernels::QuantizeParams p{ks, kernels::Fp8Format::kE4M3, true, k.columnwise, true, 0.0f};
    const auto l = kernels::ComputeLayout(ks, sh.m, k.n);
    std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
    std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
    kernels::cpu::QuantizeBlock(sh.x.data(), kernels::InputDType::kBFloat16, sh.m, k.n, p,
                                {rd.data(), rs.data(), cd.data(), cs.data()});
    const uint64_t sizes[4] = {rd.size(), rs.size() * 4, cd.size(), cs.size() * 4};
    std::vector<v1::AllGatherRequest> reqs(kWorld);
    std::vector<qtx::cuda::IpcEvent> ready, done;
    int64_t off = 0;
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_CUDA(cudaSetDevice(r));
      RankBuffers& b = bufs[r];
      auto* base = static_cast<uint8_t*>(b.base);
      // Stale bytes everywhere, synchronously; then the real shard behind a
      // 60 ms stall on the client's stream, and the ready event after it.
      ASSERT_CUDA(cudaMemset(base, 0x3C, b.bytes));
      const uint64_t in_bytes = static_cast<uint64_t>(k.rows[r] * k.n * 2);
      ASSERT_CUDA(cudaLaunchHostFunc(streams[r], SleepOnStream, nullptr));
      ASSERT_CUDA(cudaMemcpyAsync(base + b.off[0], sh.x.data() + off * k.n, in_bytes,
                                  cudaMemcpyHostToDevice, streams[r]));
      off += k.rows[r];
      absl::StatusOr<qtx::cuda::IpcEvent> e1 = qtx::cuda::IpcEvent::Create();
      absl::StatusOr<qtx::cuda::IpcEvent> e2 = qtx::cuda::IpcEvent::Create();
      ASSERT_TRUE(e1.ok() && e2.ok());
      ASSERT_CUDA(cudaEventRecord(e1->get(), streams[r]));
      v1::AllGatherRequest& req = reqs[r];
      req.set_group("ipc");
      req.set_sequence(seq);
      req.mutable_input()->set_dtype(v1::BFLOAT16);
      req.mutable_input()->add_shape(k.rows[r]);
      req.mutable_input()->add_shape(k.n);
      *req.mutable_input()->mutable_region() = Slice("buf", b.off[0], in_bytes);
      req.mutable_config()->set_scaling_mode(k.scaling);
      req.mutable_config()->set_rowwise(true);
      req.mutable_config()->set_columnwise(k.columnwise);
      req.set_mode(k.mode);
      auto* o = req.mutable_outputs();
      *o->mutable_rowwise_data() = Slice("buf", b.off[1], sizes[0]);
      *o->mutable_rowwise_scale_inv() = Slice("buf", b.off[2], sizes[1]);
      if (k.columnwise) {
        *o->mutable_columnwise_data() = Slice("buf", b.off[3], sizes[2]);
        *o->mutable_columnwise_scale_inv() = Slice("buf", b.off[4], sizes[3]);
      }
      req.mutable_cuda_events()->set_wait_event(e1->handle());
      req.mutable_cuda_events()->set_signal_event(e2->handle());
      ready.push_back(std::move(*e1));
      done.push_back(std::move(*e2));
    }
    ++seq;
    std::vector<v1::AllGatherResponse> resps;
    auto st = RunAllGather(c, reqs, &resps, absl::Seconds(60));
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
      EXPECT_THAT(resps[r].shard_rows(), ::testing::ElementsAreArray(k.rows));
      ASSERT_CUDA(cudaSetDevice(r));
      // Ordered after the sidecar's signal event, like a consumer kernel.
      ASSERT_CUDA(cudaStreamWaitEvent(streams[r], done[r].get(), 0));
      const auto* base = static_cast<const uint8_t*>(bufs[r].base);
      std::vector<uint8_t> got[4];
      for (int i = 0; i < (k.columnwise ? 4 : 2); ++i) {
        got[i].resize(sizes[i]);
        ASSERT_CUDA(cudaMemcpyAsync(got[i].data(), base + bufs[r].off[i + 1], sizes[i],
                                    cudaMemcpyDeviceToHost, streams[r]));
      }
      ASSERT_CUDA(cudaStreamSynchronize(streams[r]));
      EXPECT_TRUE(got[0] == std::vector<uint8_t>(rd.begin(), rd.end())) << "rank " << r;
      EXPECT_EQ(std::memcmp(got[1].data(), rs.data(), sizes[1]), 0) << "rank " << r;
      if (k.columnwise) {
        EXPECT_TRUE(got[2] == std::vector<uint8_t>(cd.begin(), cd.end())) << "rank " << r;
        EXPECT_EQ(std::memcmp(got[3].data(), cs.data(), sizes[3]), 0) << "rank " << r;
      }
    }
  }
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_CUDA(cudaSetDevice(r));
    ASSERT_CUDA(cudaStreamDestroy(streams[r]));
  }
}

}  // namespace
}  // namespace qtx

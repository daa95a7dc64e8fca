// End to end on a GPU (label gpu): qtxd --device=cuda:0 runs as its own
// process; this test is the client process. It allocates device memory,
// registers it by CUDA IPC, quantizes with inputs and outputs in device
// memory (with and without interprocess events), and checks every byte
// against the CPU reference (kernels::cpu). Inline and shm tensors are
// checked too (staged through pinned buffers by the sidecar).
//
// The qtxd binary: $QTXD if set, else the one this build made.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "qtx/client.h"
#include "qtx/cuda_ipc.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

extern char** environ;

namespace qtx {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

#define CUDA_ASSERT(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

using ::qtx::testing::QtxdPath;
using ::qtx::testing::QtxdProcess;

// Random input of `dtype` with normal values, some large, some exact zeros.
std::string RandomInput(kernels::InputDType dtype, int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  const size_t elem = dtype == kernels::InputDType::kFloat32 ? 4 : 2;
  std::string out(count * elem, '\0');
  for (int64_t i = 0; i < count; ++i) {
    float f = dist(rng);
    if (i % 61 == 0) f *= 3000.0f;
    if (i % 37 == 0) f = 0.0f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (dtype == kernels::InputDType::kFloat32) {
      std::memcpy(&out[i * 4], &u, 4);
    } else if (dtype == kernels::InputDType::kBFloat16) {
      const uint16_t h = static_cast<uint16_t>(u >> 16);
      std::memcpy(&out[i * 2], &h, 2);
    } else {
      // FP16 via a small range: scale down so values stay finite.
      const float g = f / 8.0f;
      std::memcpy(&u, &g, 4);
      const uint32_t sign = (u >> 16) & 0x8000u;
      int32_t exp = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
      uint16_t h = static_cast<uint16_t>(sign);
      if (exp > 0 && exp < 31) h |= static_cast<uint16_t>((exp << 10) | ((u >> 13) & 0x3ff));
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

DType ClientDType(kernels::InputDType d) {
  switch (d) {
    case kernels::InputDType::kFloat32:
      return DType::kFloat32;
    case kernels::InputDType::kBFloat16:
      return DType::kBFloat16;
    case kernels::InputDType::kFloat16:
      return DType::kFloat16;
  }
  return DType::kUnspecified;
}

struct Case {
  int64_t m, n;
  kernels::InputDType dtype;
  kernels::BlockScaling scaling;
  kernels::Fp8Format format;
  bool pow2;
  float eps;
};

// The four outputs of a case, packed at 256-byte aligned offsets.
struct Packed {
  kernels::QuantizedLayout layout;
  uint64_t offset[4] = {};
  uint64_t size[4] = {};
  uint64_t total = 0;
};

Packed Pack(const Case& c) {
  Packed p;
  p.layout = kernels::ComputeLayout(c.scaling, c.m, c.n);
  p.size[0] = p.layout.RowwiseDataBytes();
  p.size[1] = p.layout.RowwiseScaleCount() * 4;
  p.size[2] = p.layout.ColumnwiseDataBytes();
  p.size[3] = p.layout.ColumnwiseScaleCount() * 4;
  for (int i = 0; i < 4; ++i) {
    p.offset[i] = p.total;
    p.total += (p.size[i] + 255) / 256 * 256;
  }
  return p;
}

kernels::QuantizeParams ParamsOf(const Case& c) {
  kernels::QuantizeParams p;
  p.scaling = c.scaling;
  p.format = c.format;
  p.rowwise = true;
  p.columnwise = true;
  p.force_pow2_scales = c.pow2;
  p.amax_epsilon = c.eps;
  return p;
}

QuantizeConfig ConfigOf(const Case& c) {
  QuantizeConfig q;
  q.scaling_mode =
      c.scaling == kernels::BlockScaling::kBlock2D ? ScalingMode::kBlock2D : ScalingMode::kBlock1D;
  q.format = c.format == kernels::Fp8Format::kE5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  q.rowwise = true;
  q.columnwise = true;
  q.force_pow2_scales = c.pow2;
  q.amax_epsilon = c.eps;
  return q;
}

// The CPU reference's bytes of the four outputs, packed like Pack().
std::vector<uint8_t> Reference(const Case& c, const std::string& input, const Packed& p) {
  std::vector<uint8_t> out(p.total, 0);
  kernels::QuantizedBuffers b;
  b.rowwise_data = out.data() + p.offset[0];
  b.rowwise_scale_inv = reinterpret_cast<float*>(out.data() + p.offset[1]);
  b.columnwise_data = out.data() + p.offset[2];
  b.columnwise_scale_inv = reinterpret_cast<float*>(out.data() + p.offset[3]);
  kernels::cpu::QuantizeBlock(input.data(), c.dtype, c.m, c.n, ParamsOf(c), b);
  return out;
}

QuantizeOutputs OutputsIn(const std::string& region, const Packed& p) {
  QuantizeOutputs o;
  o.rowwise_data = RegionSlice{region, p.offset[0], p.size[0]};
  o.rowwise_scale_inv = RegionSlice{region, p.offset[1], p.size[1]};
  o.columnwise_data = RegionSlice{region, p.offset[2], p.size[2]};
  o.columnwise_scale_inv = RegionSlice{region, p.offset[3], p.size[3]};
  return o;
}

// Compares only the output ranges (the alignment gaps are not written).
void ExpectSameOutputs(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                       const Packed& p, const std::string& what) {
  static const char* kNames[4] = {"rowwise_data", "rowwise_scale_inv", "columnwise_data",
                                  "columnwise_scale_inv"};
  for (int i = 0; i < 4; ++i) {
    const int cmp = std::memcmp(got.data() + p.offset[i], want.data() + p.offset[i], p.size[i]);
    EXPECT_EQ(cmp, 0) << what << ": " << kNames[i] << " differs from kernels::cpu";
  }
}

class CudaE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      return;
    }
    gpu_ = true;
    auto server = QtxdProcess::Start(QtxdPath(), {"--device=cuda:0", "--allow_client_shm"},
                                     absl::Seconds(60));
    if (!server.ok()) {
      start_error_ = server.status().ToString();
      return;
    }
    server_ = server->release();
    auto client = Client::Connect(server_->target());
    if (!client.ok()) {
      start_error_ = client.status().ToString();
      return;
    }
    client_ = client->release();
  }
  static void TearDownTestSuite() {
    delete client_;
    client_ = nullptr;
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(gpu_) << "gpu-labelled test: needs a visible CUDA device";
    ASSERT_NE(client_, nullptr) << "qtxd (" << QtxdPath()
                                << ") did not start serving: " << start_error_;
    CUDA_ASSERT(cudaSetDevice(0));
  }

  static inline bool gpu_ = false;
  static inline std::string start_error_;
  static inline QtxdProcess* server_ = nullptr;
  static inline Client* client_ = nullptr;
};

const Case kCases[] = {
    {256, 1024, kernels::InputDType::kBFloat16, kernels::BlockScaling::kBlock1D,
     kernels::Fp8Format::kE4M3, true, 0.0f},
    {130, 300, kernels::InputDType::kFloat32, kernels::BlockScaling::kBlock2D,
     kernels::Fp8Format::kE5M2, false, 1e-3f},
    {1, 129, kernels::InputDType::kFloat16, kernels::BlockScaling::kBlock1D,
     kernels::Fp8Format::kE4M3, false, 0.0f},
    {513, 384, kernels::InputDType::kBFloat16, kernels::BlockScaling::kBlock2D,
     kernels::Fp8Format::kE4M3, true, 0.0f},
};

TEST_F(CudaE2ETest, IpcRegionsQuantizeInPlaceByteIdenticalToCpu) {
  int idx = 0;
  for (const Case& c : kCases) {
    const std::string what = absl::StrFormat("case %d [%d x %d]", idx, c.m, c.n);
    const std::string input = RandomInput(c.dtype, c.m * c.n, 100 + idx);
    const Packed p = Pack(c);
    void* d_in = nullptr;
    void* d_out = nullptr;
    CUDA_ASSERT(cudaMalloc(&d_in, input.size()));
    CUDA_ASSERT(cudaMalloc(&d_out, p.total));
    CUDA_ASSERT(cudaMemcpy(d_in, input.data(), input.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemset(d_out, 0xEE, p.total));
    const std::string in_name = absl::StrFormat("in%d", idx);
    const std::string out_name = absl::StrFormat("out%d", idx);
    QTX_ASSERT_OK(cuda::RegisterDevicePointer(*client_, in_name, d_in, input.size()));
    QTX_ASSERT_OK(cuda::RegisterDevicePointer(*client_, out_name, d_out, p.total));

    const Tensor t =
        Tensor::InRegion(ClientDType(c.dtype), {c.m, c.n}, RegionSlice{in_name, 0, input.size()});
    QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q,
                             client_->Quantize(t, ConfigOf(c), OutputsIn(out_name, p)));
    ASSERT_TRUE(q.rowwise_data.has_value() && q.rowwise_data->in_region());
    std::vector<uint8_t> got(p.total);
    CUDA_ASSERT(cudaMemcpy(got.data(), d_out, p.total, cudaMemcpyDeviceToHost));
    ExpectSameOutputs(got, Reference(c, input, p), p, what);

    // Dequantize from the device copies into device memory, vs the CPU.
    void* d_x = nullptr;
    CUDA_ASSERT(cudaMalloc(&d_x, c.m * c.n * 4));
    const std::string x_name = absl::StrFormat("x%d", idx);
    QTX_ASSERT_OK(cuda::RegisterDevicePointer(*client_, x_name, d_x, c.m * c.n * 4));
    QuantizedTensor colwise = q;
    colwise.rowwise_data.reset();
    colwise.rowwise_scale_inv.reset();
    QTX_ASSERT_OK(client_
                      ->Dequantize(colwise, DType::kFloat32,
                                   RegionSlice{x_name, 0, static_cast<uint64_t>(c.m * c.n * 4)})
                      .status());
    std::vector<float> got_x(c.m * c.n), want_x(c.m * c.n);
    CUDA_ASSERT(cudaMemcpy(got_x.data(), d_x, c.m * c.n * 4, cudaMemcpyDeviceToHost));
    const std::vector<uint8_t> ref = Reference(c, input, p);
    kernels::QuantizedConstBuffers in{};
    in.columnwise_data = ref.data() + p.offset[2];
    in.columnwise_scale_inv = reinterpret_cast<const float*>(ref.data() + p.offset[3]);
    kernels::cpu::DequantizeBlock(in, c.scaling, c.format, c.m, c.n, false,
                                  kernels::InputDType::kFloat32, want_x.data());
    EXPECT_EQ(std::memcmp(got_x.data(), want_x.data(), c.m * c.n * 4), 0) << what << ": dequant";

    QTX_ASSERT_OK(client_->UnregisterRegion(in_name));
    QTX_ASSERT_OK(client_->UnregisterRegion(out_name));
    QTX_ASSERT_OK(client_->UnregisterRegion(x_name));
    CUDA_ASSERT(cudaFree(d_in));
    CUDA_ASSERT(cudaFree(d_out));
    CUDA_ASSERT(cudaFree(d_x));
    ++idx;
  }
}

void CUDART_CB SleepOnStream(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms)));
}

// The input is written on the client's stream only after a 300 ms host
// callback; the sidecar must wait on the client's event (else it quantizes
// the stale 0xEE fill), return before its kernel ran (signal event), and the
// client's stream must see the outputs after waiting on the signal.
TEST_F(CudaE2ETest, EventsOrderTheCallAgainstTheClientsStream) {
  const Case c = kCases[0];
  const std::string input = RandomInput(c.dtype, c.m * c.n, 77);
  const Packed p = Pack(c);
  void* d_in = nullptr;
  void* d_out = nullptr;
  void* h_in = nullptr;
  void* h_out = nullptr;
  CUDA_ASSERT(cudaMalloc(&d_in, input.size()));
  CUDA_ASSERT(cudaMalloc(&d_out, p.total));
  CUDA_ASSERT(cudaMallocHost(&h_in, input.size()));
  CUDA_ASSERT(cudaMallocHost(&h_out, p.total));
  std::memcpy(h_in, input.data(), input.size());
  CUDA_ASSERT(cudaMemset(d_in, 0xEE, input.size()));
  CUDA_ASSERT(cudaMemset(d_out, 0xEE, p.total));
  CUDA_ASSERT(cudaDeviceSynchronize());
  QTX_ASSERT_OK(cuda::RegisterDevicePointer(*client_, "ev_in", d_in, input.size()));
  QTX_ASSERT_OK(cuda::RegisterDevicePointer(*client_, "ev_out", d_out, p.total));
  QTX_ASSERT_OK_AND_ASSIGN(cuda::IpcEvent ready, cuda::IpcEvent::Create());
  QTX_ASSERT_OK_AND_ASSIGN(cuda::IpcEvent done, cuda::IpcEvent::Create());

  for (int round = 0; round < 3; ++round) {  // cached event handles reused
    CUDA_ASSERT(cudaMemset(d_in, 0xEE, input.size()));
    CUDA_ASSERT(cudaMemset(d_out, 0xEE, p.total));
    CUDA_ASSERT(cudaDeviceSynchronize());
    cudaStream_t stream = nullptr;
    CUDA_ASSERT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    static int delay_ms = 300;
    CUDA_ASSERT(cudaLaunchHostFunc(stream, SleepOnStream, &delay_ms));
    CUDA_ASSERT(cudaMemcpyAsync(d_in, h_in, input.size(), cudaMemcpyHostToDevice, stream));
    CUDA_ASSERT(cudaEventRecord(ready.get(), stream));

    CallOptions call;
    call.cuda_wait_event = ready.handle();
    call.cuda_signal_event = done.handle();
    const auto t0 = std::chrono::steady_clock::now();
    QTX_ASSERT_OK(client_
                      ->Quantize(Tensor::InRegion(ClientDType(c.dtype), {c.m, c.n},
                                                  RegionSlice{"ev_in", 0, input.size()}),
                                 ConfigOf(c), OutputsIn("ev_out", p), call)
                      .status());
    const double call_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    // The kernel cannot have run yet: the call returned once it was enqueued.
    EXPECT_LT(call_ms, 250.0) << "round " << round << ": the call waited for the GPU work";

    CUDA_ASSERT(cudaStreamWaitEvent(stream, done.get(), 0));
    CUDA_ASSERT(cudaMemcpyAsync(h_out, d_out, p.total, cudaMemcpyDeviceToHost, stream));
    CUDA_ASSERT(cudaStreamSynchronize(stream));
    std::vector<uint8_t> got(static_cast<uint8_t*>(h_out), static_cast<uint8_t*>(h_out) + p.total);
    ExpectSameOutputs(got, Reference(c, input, p), p, absl::StrFormat("events round %d", round));
    CUDA_ASSERT(cudaStreamDestroy(stream));
  }

  // Without events the call is synchronous: outputs are complete on return.
  CUDA_ASSERT(cudaMemset(d_out, 0xEE, p.total));
  CUDA_ASSERT(cudaMemcpy(d_in, h_in, input.size(), cudaMemcpyHostToDevice));
  QTX_ASSERT_OK(client_
                    ->Quantize(Tensor::InRegion(ClientDType(c.dtype), {c.m, c.n},
                                                RegionSlice{"ev_in", 0, input.size()}),
                               ConfigOf(c), OutputsIn("ev_out", p))
                    .status());
  std::vector<uint8_t> got(p.total);
  CUDA_ASSERT(cudaMemcpy(got.data(), d_out, p.total, cudaMemcpyDeviceToHost));
  ExpectSameOutputs(got, Reference(c, input, p), p, "synchronous");

  QTX_ASSERT_OK(client_->UnregisterRegion("ev_in"));
  QTX_ASSERT_OK(client_->UnregisterRegion("ev_out"));
  CUDA_ASSERT(cudaFree(d_in));
  CUDA_ASSERT(cudaFree(d_out));
  CUDA_ASSERT(cudaFreeHost(h_in));
  CUDA_ASSERT(cudaFreeHost(h_out));
}

TEST_F(CudaE2ETest, InlineAndShmTensorsAreStagedAndMatchCpu) {
  const Case c = kCases[1];
  const std::string input = RandomInput(c.dtype, c.m * c.n, 55);
  const Packed p = Pack(c);
  const std::vector<uint8_t> want = Reference(c, input, p);

  // Inline in, inline out.
  QTX_ASSERT_OK_AND_ASSIGN(
      QuantizedTensor q,
      client_->Quantize(Tensor::Inline(ClientDType(c.dtype), {c.m, c.n}, input), ConfigOf(c)));
  std::vector<uint8_t> got(p.total, 0);
  const std::optional<Tensor>* parts[4] = {&q.rowwise_data, &q.rowwise_scale_inv,
                                           &q.columnwise_data, &q.columnwise_scale_inv};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(parts[i]->has_value());
    ASSERT_EQ((*parts[i])->data.size(), p.size[i]);
    std::memcpy(got.data() + p.offset[i], (*parts[i])->data.data(), p.size[i]);
  }
  ExpectSameOutputs(got, want, p, "inline");

  // Shm in, shm out.
  QTX_ASSERT_OK_AND_ASSIGN(auto shm_in, ShmRegion::Create("shm_in", input.size()));
  QTX_ASSERT_OK_AND_ASSIGN(auto shm_out, ShmRegion::Create("shm_out", p.total));
  std::memcpy(shm_in->data(), input.data(), input.size());
  QTX_ASSERT_OK(client_->RegisterShmRegion(*shm_in));
  QTX_ASSERT_OK(client_->RegisterShmRegion(*shm_out));
  QTX_ASSERT_OK(client_
                    ->Quantize(Tensor::InRegion(ClientDType(c.dtype), {c.m, c.n},
                                                RegionSlice{"shm_in", 0, input.size()}),
                               ConfigOf(c), OutputsIn("shm_out", p))
                    .status());
  std::vector<uint8_t> got_shm(reinterpret_cast<uint8_t*>(shm_out->data()),
                               reinterpret_cast<uint8_t*>(shm_out->data()) + p.total);
  ExpectSameOutputs(got_shm, want, p, "shm");
  QTX_ASSERT_OK(client_->UnregisterRegion("shm_in"));
  QTX_ASSERT_OK(client_->UnregisterRegion("shm_out"));
}

TEST_F(CudaE2ETest, RegistrationIsCheckedAgainstTheRealAllocation) {
  void* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, 1 << 20));
  QTX_ASSERT_OK_AND_ASSIGN(std::string handle, cuda::ExportMemHandle(d));
  ASSERT_EQ(handle.size(), 64u);
  EXPECT_THAT(client_->RegisterCudaIpcRegion("bad", handle.substr(0, 63), 0, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be exactly 64")));
  EXPECT_THAT(client_->RegisterCudaIpcRegion("bad", handle, 0, (1 << 20) + (64 << 20)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the exported")));
  EXPECT_THAT(client_->RegisterCudaIpcRegion("bad", handle, 57, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_id=57")));
  std::string junk(64, '\0');
  for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<char>(i * 37 + 11);
  EXPECT_THAT(client_->RegisterCudaIpcRegion("bad", junk, 0, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot open")));
  // The whole allocation is fine, once; a second name for it is fine too.
  QTX_ASSERT_OK(client_->RegisterCudaIpcRegion("good", handle, 0, 1 << 20));
  EXPECT_THAT(client_->RegisterCudaIpcRegion("good", handle, 0, 1 << 20),
              StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
  QTX_ASSERT_OK_AND_ASSIGN(auto regions, client_->ListRegions());
  bool listed = false;
  for (const auto& r : regions) {
    if (r.name == "good") {
      listed = true;
      EXPECT_EQ(r.kind, "cuda_ipc");
      EXPECT_EQ(r.byte_size, uint64_t{1} << 20);
    }
  }
  EXPECT_TRUE(listed);
  // Wrong-size slices of it are refused before any work.
  EXPECT_THAT(client_->Quantize(Tensor::InRegion(DType::kFloat32, {4, 128},
                                                 RegionSlice{"good", (1 << 20) - 1024, 2048}),
                                QuantizeConfig{}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  QTX_ASSERT_OK(client_->UnregisterRegion("good"));
  CUDA_ASSERT(cudaFree(d));
}

}  // namespace
}  // namespace qtx

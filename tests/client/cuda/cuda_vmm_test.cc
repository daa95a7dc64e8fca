// GPU end-to-end (label gpu): VMM memory (cuMemCreate chunks mapped with
// cuMemMap, as PyTorch's expandable_segments:True makes it) registered with
// qtxd --device=cuda:0 through file descriptors (qtx::cuda::RegionCache /
// RegisterDevicePointer -> qtxd's fd socket -> cuMemImportFromShareableHandle).
// Checks: a channel Quantize on tensors that span several chunks matches the
// CPU reference bit for bit; memory without the POSIX fd handle type, mapped
// in part, or from a cudaMallocAsync pool fails naming what to change; qtxd
// holds the physical memory after the client released it, until the region
// is unregistered or the client's session ends; a client killed with work
// parked on, or running on, VMM memory leaves qtxd serving. The kill tests
// (*Kill*) pass without MPS; under MPS on the H200 even KillSpinningClient
// (no qtx involved) fails -- MPS tears every client down when one is killed
// with a kernel running (client/README.md) -- so scripts/gpu_vmm.sh runs
// them one per process there, as an experiment.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/cuda_channel.h"
#include "qtx/cuda_ipc.h"
#include "tests/client/cuda/channel_test_kernels.h"
#include "tests/client/cuda/cuda_test_support.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace qtx {
namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::qtx::testing::Subprocess;
using ::testing::HasSubstr;

std::string g_qtxd_path;
std::string g_self_path;

#define CU_OK(expr)                                              \
  do {                                                           \
    const CUresult r_ = (expr);                                  \
    ASSERT_EQ(r_, CUDA_SUCCESS) << #expr << ": CUresult " << r_; \
  } while (0)

// `chunks` physical allocations of `chunk_bytes` each (cuMemCreate with
// `handle_types`), mapped one after another into one reserved range, read-
// write on device 0: what an expandable segment looks like. `map_bytes`
// (when not 0) maps only that much of each chunk.
struct VmmBuffer {
  std::vector<CUmemGenericAllocationHandle> handles;
  CUdeviceptr base = 0;
  uint64_t chunk_bytes = 0;
  uint64_t map_bytes = 0;
  uint64_t size = 0;

  uint64_t reserved = 0;

  // `reserve_extra` bytes of the range stay unmapped after the chunks.
  static CUresult Make(VmmBuffer* b, int chunks, uint64_t chunk_bytes,
                       CUmemAllocationHandleType handle_types, uint64_t map_bytes = 0,
                       uint64_t reserve_extra = 0) {
    b->chunk_bytes = chunk_bytes;
    b->map_bytes = map_bytes == 0 ? chunk_bytes : map_bytes;
    b->size = b->map_bytes * chunks;
    b->reserved = b->size + reserve_extra;
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = handle_types;
    CUresult r = cuMemAddressReserve(&b->base, b->reserved, 0, 0, 0);
    if (r != CUDA_SUCCESS) return r;
    for (int i = 0; i < chunks; ++i) {
      CUmemGenericAllocationHandle h;
      if ((r = cuMemCreate(&h, chunk_bytes, &prop, 0)) != CUDA_SUCCESS) return r;
      b->handles.push_back(h);
      if ((r = cuMemMap(b->base + i * b->map_bytes, b->map_bytes, 0, h, 0)) != CUDA_SUCCESS) {
        return r;
      }
    }
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return cuMemSetAccess(b->base, b->size, &access, 1);
  }
  char* ptr(uint64_t offset = 0) const { return reinterpret_cast<char*>(base + offset); }
  // Unmaps and releases this process's references.
  void Free() {
    if (base == 0) return;
    (void)cudaDeviceSynchronize();
    for (size_t i = 0; i < handles.size(); ++i) {
      (void)cuMemUnmap(base + i * map_bytes, map_bytes);
      (void)cuMemRelease(handles[i]);
    }
    (void)cuMemAddressFree(base, reserved);
    handles.clear();
    base = 0;
  }
  ~VmmBuffer() { Free(); }
};

// BF16 input [m, n] and its CPU-reference quantization (1x128, both usages).
struct Case {
  int64_t m = 0, n = 0;
  std::string input;
  std::string expected[4];
  uint64_t out_bytes[4] = {};
};

Case MakeCase(int64_t m, int64_t n, uint64_t seed) {
  Case c;
  c.m = m;
  c.n = n;
  c.input.assign(m * n * 2, '\0');
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < m * n; ++i) {
    const uint16_t h = kernels::FloatToBf16(normal(rng) * (i % 13 == 0 ? 40.0f : 1.0f));
    std::memcpy(c.input.data() + 2 * i, &h, 2);
  }
  kernels::QuantizeParams p;
  p.rowwise = p.columnwise = true;
  const kernels::QuantizedLayout layout = kernels::ComputeLayout(p.scaling, m, n);
  c.out_bytes[0] = layout.RowwiseDataBytes();
  c.out_bytes[1] = layout.RowwiseScaleCount() * 4;
  c.out_bytes[2] = layout.ColumnwiseDataBytes();
  c.out_bytes[3] = layout.ColumnwiseScaleCount() * 4;
  for (int k = 0; k < 4; ++k) c.expected[k].assign(c.out_bytes[k], '\0');
  kernels::QuantizedBuffers b;
  b.rowwise_data = reinterpret_cast<uint8_t*>(c.expected[0].data());
  b.rowwise_scale_inv = reinterpret_cast<float*>(c.expected[1].data());
  b.columnwise_data = reinterpret_cast<uint8_t*>(c.expected[2].data());
  b.columnwise_scale_inv = reinterpret_cast<float*>(c.expected[3].data());
  kernels::cpu::QuantizeBlock(c.input.data(), kernels::InputDType::kBFloat16, m, n, p, b);
  return c;
}

uint64_t CountDiffs(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return UINT64_MAX;
  uint64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += a[i] != b[i];
  return d;
}

size_t FreeDeviceBytes() {
  size_t free_bytes = 0, total = 0;
  (void)cudaMemGetInfo(&free_bytes, &total);
  return free_bytes;
}

bool HasRegion(Client& client, const std::string& name, std::string* kind = nullptr) {
  auto regions = client.ListRegions();
  if (!regions.ok()) return false;
  for (const RegionInfo& r : *regions) {
    if (r.name == name) {
      if (kind != nullptr) *kind = r.kind;
      return true;
    }
  }
  return false;
}

constexpr uint64_t kMiB = uint64_t{1} << 20;

class CudaVmmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    QTX_ASSERT_OK_AND_ASSIGN(
        server_, QtxdProcess::Start(g_qtxd_path, {"--device=cuda:0", "--allow_client_shm"}));
    QTX_ASSERT_OK_AND_ASSIGN(client_, Client::Connect(server_->target()));
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaFree(nullptr));  // the primary context, for the driver calls
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
  }

  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(CudaVmmTest, ChannelQuantizeOnTensorsSpanningChunksMatchesTheCpuReference) {
  // 6 chunks of 2 MiB; the input (4 000 000 bytes) starts 1 MiB + 256 in,
  // so it spans chunks 0..2; the outputs follow and cross chunk edges too.
  VmmBuffer buf;
  CU_OK(VmmBuffer::Make(&buf, 6, 2 * kMiB, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  const Case c = MakeCase(1000, 2000, 7);
  uint64_t at = kMiB + 256;
  const uint64_t in_off = at;
  at += c.input.size();
  uint64_t out_off[4];
  for (int k = 0; k < 4; ++k) {
    at = (at + 255) / 256 * 256;
    out_off[k] = at;
    at += c.out_bytes[k];
  }
  ASSERT_LE(at, buf.size);
  CUDA_OK(cudaMemcpy(buf.ptr(in_off), c.input.data(), c.input.size(), cudaMemcpyHostToDevice));
  QTX_ASSERT_OK_AND_ASSIGN(std::vector<qtx::cuda::VmmChunk> chunks,
                           qtx::cuda::FindVmmChunks(buf.ptr(in_off), c.input.size()));
  ASSERT_EQ(chunks.size(), 3u) << "the input should span three 2 MiB chunks";
  EXPECT_EQ(chunks[0].base, buf.base);
  EXPECT_EQ(chunks[0].size, 2 * kMiB);
  EXPECT_NE(chunks[0].block_id, chunks[1].block_id);

  qtx::cuda::RegionCache cache(*client_, "vmm");
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice in, cache.Slice(buf.ptr(in_off), c.input.size()));
  EXPECT_EQ(in.offset, in_off);
  EXPECT_EQ(cache.vmm_registrations(), 1u);
  std::string kind;
  ASSERT_TRUE(HasRegion(*client_, in.region, &kind));
  EXPECT_EQ(kind, "cuda_vmm");
  QuantizeOutputs outputs;
  std::optional<RegionSlice>* outs[4] = {&outputs.rowwise_data, &outputs.rowwise_scale_inv,
                                         &outputs.columnwise_data, &outputs.columnwise_scale_inv};
  for (int k = 0; k < 4; ++k) {
    CUDA_OK(cudaMemset(buf.ptr(out_off[k]), 0xCD, c.out_bytes[k]));
    QTX_ASSERT_OK_AND_ASSIGN(*outs[k], cache.Slice(buf.ptr(out_off[k]), c.out_bytes[k]));
  }
  // A range inside the first registration is served from the cache.
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice again, cache.Slice(buf.ptr(in_off + 4096), 1024));
  EXPECT_EQ(again.region, in.region);
  std::printf("{\"test\":\"cuda_vmm_cache\",\"registrations\":%llu}\n",
              static_cast<unsigned long long>(cache.vmm_registrations()));

  QuantizeConfig config;
  config.columnwise = true;
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  const int iters = 20;
  for (int it = 0; it < iters; ++it) {
    for (int k = 0; k < 4; ++k) {
      CUDA_OK(cudaMemsetAsync(buf.ptr(out_off[k]), 0xCD, c.out_bytes[k], stream_));
    }
    QTX_ASSERT_OK(
        ch->Quantize(Tensor::InRegion(DType::kBFloat16, {c.m, c.n}, in), config, outputs).status());
  }
  CUDA_OK(cudaStreamSynchronize(stream_));
  QTX_ASSERT_OK(ch->Synchronize());
  uint64_t diffs = 0;
  for (int k = 0; k < 4; ++k) {
    std::string got(c.out_bytes[k], '\0');
    CUDA_OK(cudaMemcpy(got.data(), buf.ptr(out_off[k]), got.size(), cudaMemcpyDeviceToHost));
    const uint64_t d = CountDiffs(got, c.expected[k]);
    EXPECT_EQ(d, 0u) << "output " << k << " differs from the CPU reference";
    diffs += d;
  }
  QTX_ASSERT_OK(ch->Close());
  // The synchronous call through the same slices gives the same bytes.
  QTX_ASSERT_OK_AND_ASSIGN(
      QuantizedTensor q,
      client_->Quantize(Tensor::InRegion(DType::kBFloat16, {c.m, c.n}, in), config));
  EXPECT_EQ(CountDiffs(q.rowwise_data->data, c.expected[0]), 0u);
  EXPECT_EQ(CountDiffs(q.columnwise_data->data, c.expected[2]), 0u);
  std::printf(
      "{\"test\":\"cuda_vmm_channel_quantize\",\"chunks_spanned\":%zu,\"iterations\":%d,"
      "\"mismatched_bytes\":%llu}\n",
      chunks.size(), iters, static_cast<unsigned long long>(diffs));

  // RegisterDevicePointer from a pointer that is not chunk-aligned.
  QTX_ASSERT_OK(
      qtx::cuda::RegisterDevicePointer(*client_, "vmm-direct", buf.ptr(in_off), c.input.size()));
  QTX_ASSERT_OK_AND_ASSIGN(
      QuantizedTensor q2,
      client_->Quantize(Tensor::InRegion(DType::kBFloat16, {c.m, c.n},
                                         RegionSlice{"vmm-direct", 0, c.input.size()}),
                        config));
  EXPECT_EQ(CountDiffs(q2.rowwise_data->data, c.expected[0]), 0u);
  QTX_ASSERT_OK(client_->UnregisterRegion("vmm-direct"));
}

TEST_F(CudaVmmTest, MemoryThatCannotBePassedFailsNamingWhatToChange) {
  qtx::cuda::RegionCache cache(*client_, "bad");
  // Chunks made without the POSIX fd handle type.
  VmmBuffer plain;
  CU_OK(VmmBuffer::Make(&plain, 2, 2 * kMiB, CU_MEM_HANDLE_TYPE_NONE));
  absl::Status s = cache.Slice(plain.ptr(100), 3 * kMiB).status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                          HasSubstr("without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")));
  EXPECT_THAT(s,
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expandable_segments:False")));
  std::printf("{\"test\":\"cuda_vmm_no_fd_type\",\"status\":\"%s\"}\n",
              std::string(s.message()).c_str());
  EXPECT_THAT(qtx::cuda::RegisterDevicePointer(*client_, "bad-direct", plain.ptr(), kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")));
  // A 4 MiB allocation of which only 2 MiB are mapped: qtxd would map the
  // allocation from its start, so a partial mapping is refused.
  // Drivers that refuse partial mappings (CUDA_ERROR_NOT_SUPPORTED: so it
  // was on an H200 with driver 580) cannot make such memory at all.
  VmmBuffer part;
  const CUresult partial =
      VmmBuffer::Make(&part, 1, 4 * kMiB, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 2 * kMiB);
  std::printf("{\"test\":\"cuda_vmm_partial_map\",\"driver_maps_part\":%s,\"cuMemMap\":%d}\n",
              partial == CUDA_SUCCESS ? "true" : "false", static_cast<int>(partial));
  if (partial == CUDA_SUCCESS) {
    EXPECT_THAT(cache.Slice(part.ptr(), kMiB),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("maps only part")));
  } else {
    EXPECT_EQ(partial, CUDA_ERROR_NOT_SUPPORTED);
  }
  // A range running off the mapped chunks.
  VmmBuffer ok;
  CU_OK(VmmBuffer::Make(&ok, 1, 2 * kMiB, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0, 2 * kMiB));
  EXPECT_THAT(cache.Slice(ok.ptr(kMiB), 2 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unmapped")));
  // cudaMallocAsync pools, default and with a POSIX fd handle type.
  void* pooled = nullptr;
  CUDA_OK(cudaMallocAsync(&pooled, kMiB, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_THAT(cache.Slice(pooled, 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backend:native")));
  CUDA_OK(cudaFreeAsync(pooled, stream_));
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypePosixFileDescriptor;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  cudaMemPool_t pool;
  CUDA_OK(cudaMemPoolCreate(&pool, &props));
  void* fd_pooled = nullptr;
  CUDA_OK(cudaMallocFromPoolAsync(&fd_pooled, 4 * kMiB, pool, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  CUmemGenericAllocationHandle probe;
  const CUresult retain = cuMemRetainAllocationHandle(&probe, fd_pooled);
  if (retain == CUDA_SUCCESS) (void)cuMemRelease(probe);
  s = cache.Slice(fd_pooled, 64).status();
  std::printf(
      "{\"test\":\"cuda_vmm_fd_pool_probe\",\"retain_allocation_handle\":%d,"
      "\"status\":\"%s\"}\n",
      static_cast<int>(retain), s.ToString().c_str());
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cudaMallocAsync")));
  CUDA_OK(cudaFreeAsync(fd_pooled, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  CUDA_OK(cudaMemPoolDestroy(pool));
  EXPECT_EQ(cache.registrations(), 0u);
}

TEST_F(CudaVmmTest, QtxdHoldsTheMemoryUntilUnregisterAndNoticesReplacedChunks) {
  const uint64_t bytes = 1024 * kMiB;
  const size_t free0 = FreeDeviceBytes();
  auto buf = std::make_unique<VmmBuffer>();
  CU_OK(VmmBuffer::Make(buf.get(), 4, bytes / 4, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  const Case c = MakeCase(256, 1024, 11);
  CUDA_OK(cudaMemcpy(buf->ptr(bytes / 4 - 1000), c.input.data(), c.input.size(),
                     cudaMemcpyHostToDevice));
  QTX_ASSERT_OK(qtx::cuda::RegisterDevicePointer(*client_, "held", buf->ptr(), bytes));
  const size_t free1 = FreeDeviceBytes();
  // The client lets go of its memory entirely: only qtxd's import holds it.
  buf->Free();
  absl::SleepFor(absl::Milliseconds(200));
  const size_t free2 = FreeDeviceBytes();
  // ... and qtxd still reads the client's bytes.
  QTX_ASSERT_OK_AND_ASSIGN(
      QuantizedTensor q,
      client_->Quantize(Tensor::InRegion(DType::kBFloat16, {c.m, c.n},
                                         RegionSlice{"held", bytes / 4 - 1000, c.input.size()}),
                        {}));
  EXPECT_EQ(CountDiffs(q.rowwise_data->data, c.expected[0]), 0u);
  QTX_ASSERT_OK(client_->UnregisterRegion("held"));
  size_t free3 = FreeDeviceBytes();
  for (int i = 0; i < 100 && free3 < free2 + bytes / 2; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    free3 = FreeDeviceBytes();
  }
  std::printf(
      "{\"test\":\"cuda_vmm_hold\",\"bytes_mib\":%llu,\"free_mib_before\":%zu,"
      "\"after_register\":%zu,\"after_client_release\":%zu,\"after_unregister\":%zu}\n",
      static_cast<unsigned long long>(bytes / kMiB), free0 / kMiB, free1 / kMiB, free2 / kMiB,
      free3 / kMiB);
  EXPECT_LE(free1 + bytes - 64 * kMiB, free0) << "the buffer should take ~1 GiB";
  EXPECT_LT(free2, free1 + 64 * kMiB) << "released by the client, the memory must stay (qtxd)";
  EXPECT_GE(free3, free2 + bytes - 64 * kMiB) << "unregister must release qtxd's mapping";

  // A chunk unmapped and replaced at the same address: RegionCache notices
  // (the block id changes) and registers afresh.
  qtx::cuda::RegionCache cache(*client_, "re");
  VmmBuffer a;
  CU_OK(VmmBuffer::Make(&a, 1, 2 * kMiB, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice s1, cache.Slice(a.ptr(), 4096));
  const CUdeviceptr addr = a.base;
  CU_OK(cuMemUnmap(a.base, 2 * kMiB));
  CU_OK(cuMemRelease(a.handles[0]));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CU_OK(cuMemCreate(&a.handles[0], 2 * kMiB, &prop, 0));
  CU_OK(cuMemMap(addr, 2 * kMiB, 0, a.handles[0], 0));
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_OK(cuMemSetAccess(addr, 2 * kMiB, &access, 1));
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice s2, cache.Slice(a.ptr(), 4096));
  EXPECT_NE(s2.region, s1.region);
  EXPECT_EQ(cache.vmm_registrations(), 2u);
  EXPECT_FALSE(HasRegion(*client_, s1.region)) << "the stale registration must be dropped";
}

// Runs this executable in `mode` against `target`, its stdout in a pipe
// (Subprocess::stdout_fd); null (and a test failure) if it cannot start.
std::unique_ptr<Subprocess> SpawnChild(const std::string& mode, const std::string& target) {
  Subprocess::Options options;
  options.pipe_stdout = true;
  absl::StatusOr<std::unique_ptr<Subprocess>> child =
      Subprocess::Start({g_self_path, "--" + mode + "=" + target}, options);
  if (!child.ok()) {
    ADD_FAILURE() << mode << ": " << child.status();
    return nullptr;
  }
  return *std::move(child);
}

std::string ReadLine(int fd) {
  std::string line;
  char ch;
  while (::read(fd, &ch, 1) == 1 && ch != '\n') line.push_back(ch);
  return line;
}

TEST_F(CudaVmmTest, AClientsRegionsGoWithItsSession) {
  const size_t free0 = FreeDeviceBytes();
  const std::unique_ptr<Subprocess> child = SpawnChild("vmm_hold_child", server_->target());
  ASSERT_NE(child, nullptr);
  const std::string line = ReadLine(child->stdout_fd());
  ASSERT_EQ(line, "registered");
  EXPECT_TRUE(HasRegion(*client_, "child-vmm"));
  child->Kill();
  const absl::Time killed = absl::Now();
  bool gone = false;
  // qtxd drops a dead client's regions after a 5 s grace (fd_inbox.h).
  while (absl::Now() - killed < absl::Seconds(15)) {
    if (!HasRegion(*client_, "child-vmm")) {
      gone = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(gone) << "the dead client's region is still registered 15 s later";
  size_t free1 = FreeDeviceBytes();
  for (int i = 0; i < 100 && free1 + 64 * kMiB < free0; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    free1 = FreeDeviceBytes();
  }
  std::printf(
      "{\"test\":\"cuda_vmm_session_end\",\"region_dropped_ms\":%.1f,"
      "\"free_mib_before\":%zu,\"free_mib_after\":%zu}\n",
      absl::ToDoubleMilliseconds(absl::Now() - killed), free0 / kMiB, free1 / kMiB);
  EXPECT_GE(free1 + 64 * kMiB, free0) << "the dead client's 512 MiB must be freed";
  QTX_ASSERT_OK_AND_ASSIGN(ServingStatus health, client_->Health());
  EXPECT_EQ(health, ServingStatus::kServing);
}

// The client dies (SIGKILL) while qtxd's channel work on its VMM memory is
// parked: qtxd's import keeps the memory, so the work runs on live memory
// and qtxd keeps serving. (Under MPS the kill of the child's running spin
// kernel alone takes every client down: see KillSpinningClient.)
TEST_F(CudaVmmTest, AClientKilledWithParkedWorkOnVmmMemoryLeavesQtxdServing) {
  const std::unique_ptr<Subprocess> child = SpawnChild("vmm_park_child", server_->target());
  ASSERT_NE(child, nullptr);
  const std::string line = ReadLine(child->stdout_fd());
  ASSERT_EQ(line, "parked");
  child->Kill();
  const absl::Time killed = absl::Now();
  QTX_ASSERT_OK_AND_ASSIGN(ServingStatus health, client_->Health());
  EXPECT_EQ(health, ServingStatus::kServing);
  // New work on new VMM memory, through a channel, is right.
  VmmBuffer buf;
  CU_OK(VmmBuffer::Make(&buf, 2, 2 * kMiB, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  const Case c = MakeCase(256, 1024, 5);
  CUDA_OK(cudaMemcpy(buf.ptr(kMiB), c.input.data(), c.input.size(), cudaMemcpyHostToDevice));
  qtx::cuda::RegionCache cache(*client_, "after");
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice in, cache.Slice(buf.ptr(kMiB), c.input.size()));
  QuantizeOutputs outputs;
  const uint64_t out_off = kMiB + c.input.size();
  QTX_ASSERT_OK_AND_ASSIGN(outputs.rowwise_data, cache.Slice(buf.ptr(out_off), c.out_bytes[0]));
  QTX_ASSERT_OK_AND_ASSIGN(outputs.rowwise_scale_inv,
                           cache.Slice(buf.ptr(out_off + c.out_bytes[0]), c.out_bytes[1]));
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  QTX_ASSERT_OK(
      ch->Quantize(Tensor::InRegion(DType::kBFloat16, {c.m, c.n}, in), {}, outputs).status());
  QTX_ASSERT_OK(ch->Synchronize());
  std::string got(c.out_bytes[0], '\0');
  CUDA_OK(cudaMemcpy(got.data(), buf.ptr(out_off), got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(CountDiffs(got, c.expected[0]), 0u);
  QTX_ASSERT_OK(ch->Close());
  // The dead client's region went with its session.
  for (int i = 0; i < 1500 && HasRegion(*client_, "park-0"); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_FALSE(HasRegion(*client_, "park-0"));
  QTX_ASSERT_OK_AND_ASSIGN(health, client_->Health());
  EXPECT_EQ(health, ServingStatus::kServing);
  std::printf(
      "{\"test\":\"cuda_vmm_client_killed\",\"qtxd_serving\":true,\"after_kill_ms\":%.1f}\n",
      absl::ToDoubleMilliseconds(absl::Now() - killed));
}

// After a child was killed: this process's CUDA context and qtxd still work,
// and a new channel Quantize on new VMM memory is right. Prints one line
// with the time each step took and, on a failure, the step and its status.
void CheckAliveAfterKill(Client& client, cudaStream_t stream, const char* what) {
  const absl::Time t0 = absl::Now();
  std::string timings;
  std::string failed_step;
  std::string failure;
  auto step = [&](const char* name, const absl::Status& s) {
    absl::StrAppend(&timings, timings.empty() ? "" : ",", "\"", name, "_ms\":",
                    absl::StrFormat("%.1f", absl::ToDoubleMilliseconds(absl::Now() - t0)));
    if (!s.ok() && failed_step.empty()) {
      failed_step = name;
      failure = s.ToString();
    }
    return s.ok();
  };
  auto cuda = [](cudaError_t e) {
    return e == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(e));
  };
  const cudaError_t sync = cudaDeviceSynchronize();
  EXPECT_EQ(sync, cudaSuccess) << what << ": this process's context: " << cudaGetErrorString(sync);
  step("device_sync", cuda(sync));
  auto health = client.Health();
  const bool serving = health.ok() && *health == ServingStatus::kServing;
  EXPECT_TRUE(serving) << what << ": qtxd not serving";
  step("health", serving ? absl::OkStatus() : absl::UnavailableError("not serving"));
  uint64_t diffs = UINT64_MAX;
  VmmBuffer buf;
  const Case c = MakeCase(256, 1024, 9);
  if (sync == cudaSuccess && serving &&
      step("vmm_alloc", VmmBuffer::Make(&buf, 1, 2 * kMiB,
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == CUDA_SUCCESS
                            ? absl::OkStatus()
                            : absl::InternalError("VmmBuffer::Make")) &&
      step("copy_in",
           cuda(cudaMemcpy(buf.ptr(), c.input.data(), c.input.size(), cudaMemcpyHostToDevice)))) {
    qtx::cuda::RegionCache cache(client, std::string("alive-") + what);
    auto in = cache.Slice(buf.ptr(), c.input.size());
    auto d = in.ok() ? cache.Slice(buf.ptr(kMiB), c.out_bytes[0]) : in.status();
    auto sc = d.ok() ? cache.Slice(buf.ptr(kMiB + c.out_bytes[0]), c.out_bytes[1]) : d.status();
    if (step("register", sc.status())) {
      auto ch = qtx::cuda::OpenChannel(client, stream);
      if (step("open_channel", ch.status())) {
        QuantizeOutputs outputs;
        outputs.rowwise_data = *d;
        outputs.rowwise_scale_inv = *sc;
        if (step("submit",
                 (*ch)
                     ->Quantize(Tensor::InRegion(DType::kBFloat16, {c.m, c.n}, *in), {}, outputs)
                     .status()) &&
            step("synchronize", (*ch)->Synchronize())) {
          std::string got(c.out_bytes[0], '\0');
          if (step("copy_out", cuda(cudaMemcpy(got.data(), buf.ptr(kMiB), got.size(),
                                               cudaMemcpyDeviceToHost)))) {
            diffs = CountDiffs(got, c.expected[0]);
          }
        }
        step("close", (*ch)->Close());
      }
    }
  }
  EXPECT_EQ(diffs, 0u) << what << ": a new channel Quantize after the kill; failed step "
                       << failed_step << ": " << failure;
  std::printf(
      "{\"test\":\"kill_%s\",\"context_ok\":%s,\"qtxd_serving\":%s,\"new_op_ok\":%s,%s,"
      "\"failed_step\":\"%s\"}\n",
      what, sync == cudaSuccess ? "true" : "false", serving ? "true" : "false",
      diffs == 0 ? "true" : "false", timings.c_str(), failed_step.c_str());
  std::fflush(stdout);
}

// Control for the MPS question: a client that only runs a long kernel
// (no qtx at all) is killed.
TEST_F(CudaVmmTest, KillSpinningClient) {
  const std::unique_ptr<Subprocess> child = SpawnChild("spin_child", "x");
  ASSERT_NE(child, nullptr);
  ASSERT_EQ(ReadLine(child->stdout_fd()), "spinning");
  child->Kill();
  absl::SleepFor(absl::Milliseconds(500));
  CheckAliveAfterKill(*client_, stream_, "spinning_client");
}

// A client killed while qtxd's queued work (a burst of channel Quantizes,
// nothing parked on the client's side but its waits for "done") still reads
// and writes the client's memory: VMM memory imported by qtxd, or cudaMalloc
// memory opened by CUDA IPC.
void KillBusyClient(Client& client, QtxdProcess& server, cudaStream_t stream, const char* kind) {
  const std::unique_ptr<Subprocess> child =
      SpawnChild(std::string("busy_child_") + kind, server.target());
  ASSERT_NE(child, nullptr);
  const absl::Time spawned = absl::Now();
  const std::string line = ReadLine(child->stdout_fd());
  ASSERT_EQ(line, "submitted") << line;
  std::printf("{\"test\":\"busy_child_%s\",\"submitted_after_ms\":%.1f}\n", kind,
              absl::ToDoubleMilliseconds(absl::Now() - spawned));
  std::fflush(stdout);
  child->Kill();
  absl::SleepFor(absl::Milliseconds(1500));
  CheckAliveAfterKill(client, stream, (std::string("busy_client_") + kind).c_str());
}

TEST_F(CudaVmmTest, KillBusyClientVmm) { KillBusyClient(*client_, *server_, stream_, "vmm"); }
TEST_F(CudaVmmTest, KillBusyClientIpc) { KillBusyClient(*client_, *server_, stream_, "ipc"); }

// --spin_child=x: a 30 s kernel on its stream; say "spinning", wait.
int SpinChild() {
  cudaStream_t stream;
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      qtx::testing::LaunchSpin(30'000'000'000ull, stream) != cudaSuccess) {
    return 1;
  }
  absl::SleepFor(absl::Milliseconds(100));
  std::printf("spinning\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(60));
  return 0;
}

// --busy_child_<vmm|ipc>=<target>: 512 MiB (VMM chunks or cudaMalloc), a
// channel with 1000 Quantizes of a [8192, 16384] BF16 tensor submitted
// without waiting; say "submitted", wait to be killed.
int BusyChild(bool vmm, const std::string& target) {
  auto client = Client::Connect(target);
  if (!client.ok() || cudaSetDevice(0) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) return 1;
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 1;
  const uint64_t bytes = 512 * kMiB;
  VmmBuffer vbuf;
  char* base = nullptr;
  if (vmm) {
    if (VmmBuffer::Make(&vbuf, 2, bytes / 2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) !=
        CUDA_SUCCESS) {
      return 1;
    }
    base = vbuf.ptr();
  } else if (cudaMalloc(reinterpret_cast<void**>(&base), bytes) != cudaSuccess) {
    return 1;
  }
  if (cudaMemset(base, 0x3C, bytes) != cudaSuccess) return 1;
  const int64_t m = 8192, n = 16384;
  qtx::cuda::RegionCache cache(**client, "busy");
  auto in = cache.Slice(base, m * n * 2);
  auto data = cache.Slice(base + m * n * 2, m * n);
  auto scales = cache.Slice(base + m * n * 3, m * (n / 128) * 4);
  if (!in.ok() || !data.ok() || !scales.ok()) {
    std::printf("error %s %s %s\n", in.status().ToString().c_str(),
                data.status().ToString().c_str(), scales.status().ToString().c_str());
    return 1;
  }
  auto ch = qtx::cuda::OpenChannel(**client, stream);
  if (!ch.ok()) return 1;
  QuantizeOutputs outputs;
  outputs.rowwise_data = *data;
  outputs.rowwise_scale_inv = *scales;
  // QTX_TEST_BUSY_OPS: another number of operations (for diagnosis).
  const char* ops_env = std::getenv("QTX_TEST_BUSY_OPS");
  const int ops = ops_env != nullptr ? std::atoi(ops_env) : 1000;
  for (int i = 0; i < ops; ++i) {
    if (!(*ch)->Quantize(Tensor::InRegion(DType::kBFloat16, {m, n}, *in), {}, outputs).ok()) {
      return 1;
    }
  }
  std::printf("submitted\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(60));
  return 0;
}

// --vmm_hold_child=<target>: register 512 MiB of VMM memory, say
// "registered", wait to be killed.
int HoldChild(const std::string& target) {
  auto client = Client::Connect(target);
  if (!client.ok() || cudaSetDevice(0) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) return 1;
  VmmBuffer buf;
  if (VmmBuffer::Make(&buf, 2, 256 * kMiB, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) !=
      CUDA_SUCCESS) {
    return 1;
  }
  absl::Status s = qtx::cuda::RegisterDevicePointer(**client, "child-vmm", buf.ptr(), buf.size);
  if (!s.ok()) {
    std::printf("error %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("registered\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(60));
  return 0;
}

// --vmm_park_child=<target>: a channel op on VMM memory parked behind a 30 s
// spin on the caller's stream; say "parked", wait to be killed.
int ParkChild(const std::string& target) {
  auto client = Client::Connect(target);
  if (!client.ok() || cudaSetDevice(0) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) return 1;
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 1;
  VmmBuffer buf;
  if (VmmBuffer::Make(&buf, 2, 2 * kMiB, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) !=
      CUDA_SUCCESS) {
    return 1;
  }
  qtx::cuda::RegionCache cache(**client, "park");
  auto in = cache.Slice(buf.ptr(2 * kMiB - 256 * 1024), 256 * 1024 * 2);  // spans both chunks
  auto data = cache.Slice(buf.ptr(0), 256 * 1024);
  auto scales = cache.Slice(buf.ptr(512 * 1024), 256 * 8 * 4);
  if (!in.ok() || !data.ok() || !scales.ok()) return 1;
  auto ch = qtx::cuda::OpenChannel(**client, stream);
  if (!ch.ok()) return 1;
  if (qtx::testing::LaunchSpin(30'000'000'000ull, stream) != cudaSuccess) return 1;
  QuantizeOutputs outputs;
  outputs.rowwise_data = *data;
  outputs.rowwise_scale_inv = *scales;
  auto op = (*ch)->Quantize(Tensor::InRegion(DType::kBFloat16, {256, 1024}, *in), {}, outputs);
  if (!op.ok()) return 1;
  std::printf("parked\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(60));
  return 0;
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  qtx::g_self_path = argv[0];
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--vmm_hold_child=")) return qtx::HoldChild(arg.substr(17));
    if (absl::StartsWith(arg, "--vmm_park_child=")) return qtx::ParkChild(arg.substr(17));
    if (absl::StartsWith(arg, "--spin_child=")) return qtx::SpinChild();
    if (absl::StartsWith(arg, "--busy_child_vmm=")) return qtx::BusyChild(true, arg.substr(17));
    if (absl::StartsWith(arg, "--busy_child_ipc=")) return qtx::BusyChild(false, arg.substr(17));
  }
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}

// What the GPU tests of the client share: a gtest assertion for CUDA runtime
// calls, a registered device arena carved into slices, and the fixture of
// the tests on a one-rank NCCL group of a CUDA qtxd.
#ifndef QTX_TESTS_CLIENT_CUDA_CUDA_TEST_SUPPORT_H_
#define QTX_TESTS_CLIENT_CUDA_CUDA_TEST_SUPPORT_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "qtx/client.h"
#include "qtx/cuda_ipc.h"
#include "qtx/types.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

// ASSERTs that a CUDA runtime call succeeded, naming the call and the error.
#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

namespace qtx::testing {

// One device allocation registered as a CUDA IPC region (by the test), carved
// by a bump allocator into 256-byte aligned slices.
struct DeviceArena {
  void* base = nullptr;
  uint64_t size = 0;
  uint64_t used = 0;
  std::string name;
  RegionSlice Take(uint64_t bytes) {
    RegionSlice s{name, used, bytes};
    used += (bytes + 255) / 256 * 256;
    EXPECT_LE(used, size);
    return s;
  }
  void* At(const RegionSlice& s) const { return static_cast<char*>(base) + s.offset; }
};

// A qtxd on cuda:0 with a client, a non-blocking stream on device 0, a
// registered DeviceArena and the one-rank NCCL group kSoloGroup.
class SoloNcclGroupTest : public ::testing::Test {
 protected:
  static constexpr char kSoloGroup[] = "solo";

  // Starts qtxd (`qtxd_path` with `flags`) and sets up the rest; ASSERTs, so
  // call it from SetUp (a failure ends the test there).
  void StartSolo(const std::string& qtxd_path, const std::vector<std::string>& flags,
                 uint64_t arena_bytes, const std::string& arena_name) {
    QTX_ASSERT_OK_AND_ASSIGN(server_, QtxdProcess::Start(qtxd_path, flags));
    QTX_ASSERT_OK_AND_ASSIGN(client_, Client::Connect(server_->target()));
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    arena_.size = arena_bytes;
    arena_.name = arena_name;
    CUDA_OK(cudaMalloc(&arena_.base, arena_.size));
    QTX_ASSERT_OK(
        qtx::cuda::RegisterDevicePointer(*client_, arena_.name, arena_.base, arena_.size));
    CollectiveGroupConfig group;
    group.name = kSoloGroup;
    group.rank = 0;
    group.world_size = 1;
    group.backend = CommBackend::kNccl;
    group.timeout = absl::Seconds(60);
    QTX_ASSERT_OK(client_->CreateGroup(group).status());
  }

  // Waits for the stream, destroys the group, unregisters and frees the arena
  // and destroys the stream (each only if it was made); qtxd stops with
  // server_. A subclass that overrides it frees its own buffers after
  // SyncStream() and calls this last.
  void TearDown() override {
    SyncStream();
    if (client_ != nullptr && server_ != nullptr) {
      (void)client_->DestroyGroup(kSoloGroup);
      (void)client_->UnregisterRegion(arena_.name);
    }
    if (arena_.base != nullptr) (void)cudaFree(arena_.base);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  void SyncStream() {
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  }

  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
};

}  // namespace qtx::testing

#endif  // QTX_TESTS_CLIENT_CUDA_CUDA_TEST_SUPPORT_H_

// NcclCommunicator on its own (label gpu): a one-rank group on device 0 with
// a KvStore as the rendezvous store — what one H200 can run. Every operation
// of the Communicator interface moves the right bytes (device memory), in place
// and not; AllGatherVParts and AllGatherHost; enqueue_only returns before the
// stream has run the collective; bad options and bad arguments are refused
// before anything moves; Abort and a passed deadline break the communicator
// for good (ABORTED afterwards). The multi-rank paths run in nccl_e2e_test
// (two GPUs).
#include "server/backend/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/kv_store.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::backend {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};

absl::Time In(absl::Duration d) { return absl::Now() + d; }

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    NcclCommunicatorOptions o;
    o.group = "solo";
    o.key_prefix = "solo/";
    o.store = &store_;
    o.deadline = In(absl::Seconds(60));
    QTX_ASSERT_OK_AND_ASSIGN(comm_, NcclCommunicator::Create(o));
  }
  void TearDown() override {
    comm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void* Alloc(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    owned_.emplace_back(p);
    return p;
  }
  std::vector<uint8_t> Download(const void* p, size_t bytes) {
    std::vector<uint8_t> h(bytes);
    EXPECT_EQ(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

  collective::KvStore store_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<NcclCommunicator> comm_;
  std::vector<std::unique_ptr<void, DeviceFree>> owned_;
};

TEST_F(NcclCommunicatorTest, NameRankAndMemory) {
  EXPECT_THAT(comm_->name(), HasSubstr("solo"));
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->world_size(), 1);
  EXPECT_EQ(comm_->memory_kind(), tensor::MemoryKind::kDevice);
}

TEST_F(NcclCommunicatorTest, AllGatherVMovesTheBytesInPlaceAndNot) {
  const uint64_t n = 1 << 20;
  std::vector<uint8_t> src(n);
  for (uint64_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  auto* send = static_cast<uint8_t*>(Alloc(n));
  auto* recv = static_cast<uint8_t*>(Alloc(n));
  CUDA_OK(cudaMemcpy(send, src.data(), n, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(recv, 0, n));
  const std::vector<uint64_t> sizes = {n};
  CommCall call{In(absl::Seconds(30)), stream_};
  QTX_ASSERT_OK(comm_->AllGatherV(send, sizes, recv, call));
  EXPECT_EQ(Download(recv, n), src);
  // In place: send is recv + 0.
  QTX_ASSERT_OK(comm_->AllGatherV(recv, sizes, recv, call));
  EXPECT_EQ(Download(recv, n), src);
  // Zero bytes with null pointers.
  const std::vector<uint64_t> none = {0};
  QTX_EXPECT_OK(comm_->AllGatherV(nullptr, none, nullptr, call));
}

TEST_F(NcclCommunicatorTest, PartsHostGatherMaxAndBarrier) {
  auto* a = static_cast<uint8_t*>(Alloc(4096));
  auto* b = static_cast<uint8_t*>(Alloc(4096));
  auto* ra = static_cast<uint8_t*>(Alloc(4096));
  auto* rb = static_cast<uint8_t*>(Alloc(4096));
  CUDA_OK(cudaMemset(a, 0x11, 4096));
  CUDA_OK(cudaMemset(b, 0x22, 4096));
  const std::vector<uint64_t> sa = {4096}, sb = {1000};
  const Communicator::GatherPart parts[] = {{a, sa, ra}, {b, sb, rb}};
  CommCall call{In(absl::Seconds(30)), stream_};
  QTX_ASSERT_OK(comm_->AllGatherVParts(parts, call));
  EXPECT_EQ(Download(ra, 4096), std::vector<uint8_t>(4096, 0x11));
  EXPECT_EQ(Download(rb, 1000), std::vector<uint8_t>(1000, 0x22));

  const char msg[] = "agreement digest";
  char got[sizeof(msg)] = {};
  bool in_flight_called = false;
  QTX_ASSERT_OK(
      comm_->AllGatherHost(msg, sizeof(msg), got, call, [&] { in_flight_called = true; }));
  EXPECT_STREQ(got, msg);
  EXPECT_TRUE(in_flight_called);

  const std::vector<float> v = {1.5f, -2.0f, 0.0f, 448.0f};
  auto* d = static_cast<float*>(Alloc(v.size() * 4));
  CUDA_OK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  QTX_ASSERT_OK(comm_->AllReduceMax(d, v.size(), call));
  std::vector<float> back(v.size());
  CUDA_OK(cudaMemcpy(back.data(), d, v.size() * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, v);  // one rank: the max over ranks is the rank's own values
  QTX_EXPECT_OK(comm_->Barrier(call));
}

// enqueue_only returns while the stream is still held by earlier work; the
// gathered bytes are there once the stream drains.
TEST_F(NcclCommunicatorTest, EnqueueOnlyReturnsBeforeTheStreamRuns) {
  const uint64_t n = 64 << 10;
  auto* send = static_cast<uint8_t*>(Alloc(n));
  auto* recv = static_cast<uint8_t*>(Alloc(n));
  CUDA_OK(cudaMemset(send, 0x5A, n));
  CUDA_OK(cudaMemset(recv, 0, n));
  // Hold the stream: a host function that waits until released.
  std::atomic<bool> release{false};
  struct Hold {
    static void CUDART_CB Fn(void* p) {
      auto* r = static_cast<std::atomic<bool>*>(p);
      while (!r->load()) {
      }
    }
  };
  CUDA_OK(cudaLaunchHostFunc(stream_, &Hold::Fn, &release));
  const std::vector<uint64_t> sizes = {n};
  CommCall call{In(absl::Seconds(30)), stream_};
  call.enqueue_only = true;
  QTX_ASSERT_OK(comm_->AllGatherV(send, sizes, recv, call));
  EXPECT_EQ(cudaStreamQuery(stream_), cudaErrorNotReady) << "the call waited for the stream";
  release.store(true);
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(Download(recv, n), std::vector<uint8_t>(n, 0x5A));
}

TEST_F(NcclCommunicatorTest, BadArgumentsAreRefusedAndLeaveItUsable) {
  const std::vector<uint64_t> two = {1, 1};
  EXPECT_THAT(comm_->AllGatherV(nullptr, two, nullptr, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(comm_->name())));
  // INVALID_ARGUMENT does not break the communicator.
  QTX_EXPECT_OK(comm_->Barrier({In(absl::Seconds(30)), stream_}));
}

TEST_F(NcclCommunicatorTest, AbortBreaksItForGood) {
  comm_->Abort();
  EXPECT_THAT(comm_->Barrier({In(absl::Seconds(30)), stream_}),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("aborted")));
  EXPECT_THAT(comm_->Barrier({In(absl::Seconds(30)), stream_}),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("aborted")));
}

TEST_F(NcclCommunicatorTest, APassedDeadlineFailsTheCall) {
  const absl::Status s = comm_->Barrier({absl::Now() - absl::Seconds(1), stream_});
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("deadline")));
}

TEST(NcclCommunicatorOptionsTest, BadOptionsAreInvalidArguments) {
  collective::KvStore store;
  NcclCommunicatorOptions o;
  o.group = "bad";
  o.store = &store;
  o.deadline = In(absl::Seconds(5));
  o.rank = 1;  // world_size 1
  EXPECT_THAT(NcclCommunicator::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank=1")));
  o.rank = 0;
  o.world_size = 0;
  EXPECT_THAT(NcclCommunicator::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size=0")));
  o.world_size = 1;
  o.store = nullptr;
  EXPECT_THAT(NcclCommunicator::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no rendezvous store")));
  o.store = &store;
  o.device_ordinal = -1;
  EXPECT_THAT(NcclCommunicator::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_ordinal=-1")));
}

}  // namespace
}  // namespace qtx::server::backend

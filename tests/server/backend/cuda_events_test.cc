// Validation of interprocess CUDA events in the ops, before any work: wrong
// handle lengths and events sent to a host device. Runs on the CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "server/backend/cpu_device.h"
#include "server/ops/quantize.h"
#include "server/tensor/region_table.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

// A device that claims device memory, runs the CPU kernels and records what
// it is asked to do.
class CountingDevice final : public backend::Device {
 public:
  std::string name() const override { return "counting"; }
  tensor::MemoryKind memory_kind() const override { return tensor::MemoryKind::kDevice; }
  absl::StatusOr<backend::DeviceBuffer> Allocate(uint64_t bytes) override {
    return cpu_.Allocate(bytes);
  }
  absl::Status CopyFromHost(void* d, const void* s, uint64_t b) override {
    return cpu_.CopyFromHost(d, s, b);
  }
  absl::Status CopyToHost(void* d, const void* s, uint64_t b) override {
    return cpu_.CopyToHost(d, s, b);
  }
  absl::Status Quantize(const backend::QuantizeArgs& args) override {
    ++quantize_calls;
    last_events = args.events;
    return cpu_.Quantize(args);
  }
  absl::Status Dequantize(const backend::DequantizeArgs& args) override {
    return cpu_.Dequantize(args);
  }
  absl::Status ShardBoundaryAmax(const backend::ShardArgs& a, float* f, float* l) override {
    return cpu_.ShardBoundaryAmax(a, f, l);
  }
  absl::Status QuantizeShard(const backend::ShardArgs& a, const float* f, const float* l,
                             const kernels::QuantizedBuffers& out) override {
    return cpu_.QuantizeShard(a, f, l, out);
  }
  absl::Status AssembleShards(int w, const kernels::ShardGeometry* g,
                              const kernels::QuantizedConstBuffers* s,
                              const kernels::QuantizeParams& p,
                              const kernels::QuantizedBuffers& out) override {
    return cpu_.AssembleShards(w, g, s, p, out);
  }
  int quantize_calls = 0;
  backend::CudaEvents last_events;

 private:
  backend::CpuDevice cpu_;
};

class CudaEventsTest : public ::testing::Test {
 protected:
  CudaEventsTest() : regions_(tensor::RegionTableOptions{}) {
    ctx_.regions = &regions_;
    ctx_.device = &cpu_;
  }
  ops::QuantizeRequestSpec Request() {
    ops::QuantizeRequestSpec req;
    req.input.dtype = tensor::DType::kFloat32;
    req.input.shape = {2, 4};
    req.input.data = std::string_view(input_);
    return req;
  }
  tensor::RegionTable regions_;
  backend::CpuDevice cpu_;
  ops::OpContext ctx_;
  std::string input_ = std::string(2 * 4 * sizeof(float), '\0');
};

TEST_F(CudaEventsTest, NoEventsIsOkOnAnyDevice) {
  QTX_EXPECT_OK(ops::ValidateCudaEvents({}, ctx_));
  QTX_EXPECT_OK(ops::Quantize(Request(), ctx_).status());
}

TEST_F(CudaEventsTest, WrongHandleLengthsAreInvalidArgument) {
  CountingDevice device;
  ctx_.device = &device;
  for (size_t len : {1u, 63u, 65u, 128u}) {
    ops::QuantizeRequestSpec req = Request();
    req.events.wait_event = std::string(len, 'w');
    EXPECT_THAT(ops::Quantize(req, ctx_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrFormat("cuda_events.wait_event: %d bytes, must be "
                                                   "exactly 64",
                                                   len))));
    req.events.wait_event.clear();
    req.events.signal_event = std::string(len, 's');
    EXPECT_THAT(ops::Quantize(req, ctx_), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   HasSubstr("cuda_events.signal_event")));
  }
  EXPECT_EQ(device.quantize_calls, 0);  // rejected before any work
}

TEST_F(CudaEventsTest, EventsOnAHostDeviceAreFailedPrecondition) {
  ops::QuantizeRequestSpec req = Request();
  req.events.signal_event = std::string(64, 's');
  EXPECT_THAT(ops::Quantize(req, ctx_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("need a CUDA device, but this server computes on cpu")));
  ops::DequantizeRequestSpec dq;
  dq.events.wait_event = std::string(64, 'w');
  EXPECT_THAT(ops::Dequantize(dq, ctx_),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cuda_events")));
}

TEST_F(CudaEventsTest, ValidEventsReachTheDevice) {
  CountingDevice device;
  ctx_.device = &device;
  ops::QuantizeRequestSpec req = Request();
  req.events.wait_event = std::string(64, 'w');
  req.events.signal_event = std::string(64, 's');
  QTX_ASSERT_OK(ops::Quantize(req, ctx_).status());
  EXPECT_EQ(device.quantize_calls, 1);
  EXPECT_EQ(device.last_events.wait_event, req.events.wait_event);
  EXPECT_EQ(device.last_events.signal_event, req.events.signal_event);
}

TEST(CudaIpcRegions, HandleMustBeExactly64Bytes) {
  int opened = 0;
  tensor::RegionTableOptions options;
  options.cuda_ipc_opener = [&](std::string_view, int32_t,
                                uint64_t) -> absl::StatusOr<tensor::MappedMemory> {
    ++opened;
    return tensor::MappedMemory{};
  };
  tensor::RegionTable table(options);
  for (size_t len : {0u, 32u, 63u, 65u}) {
    EXPECT_THAT(table.RegisterCudaIpc("r", std::string(len, 'h'), 0, 1024),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be exactly 64")))
        << len;
  }
  EXPECT_EQ(opened, 0);
  QTX_EXPECT_OK(table.RegisterCudaIpc("r", std::string(64, 'h'), 0, 1024));
  EXPECT_EQ(opened, 1);
}

}  // namespace
}  // namespace qtx::server

// Test helpers of tests/server/ops: OpTest, the fixture of an op test on the
// CPU device (a client shm object registered as region "r", the CPU device
// and an OpContext over them), and QuantizeReference, the expected bytes of a
// quantization (kernels::cpu::QuantizeBlock called directly). One test thread.
#ifndef QTX_TESTS_SERVER_TESTING_OP_TEST_H_
#define QTX_TESTS_SERVER_TESTING_OP_TEST_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "server/backend/cpu_device.h"
#include "server/ops/op_context.h"
#include "server/tensor/region_table.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::testing {

// The FP8 copies and FP32 scales of one quantization, as bytes; a copy that
// was not requested is empty.
struct QuantizedBytes {
  std::string rowwise_data, rowwise_scale, columnwise_data, columnwise_scale;
};

// kernels::cpu::QuantizeBlock of the [m, n] `input`, into buffers prefilled
// with 0x55 (so that a byte the kernel leaves alone shows).
inline QuantizedBytes QuantizeReference(const void* input, kernels::InputDType dtype, int64_t m,
                                        int64_t n, const kernels::QuantizeParams& p) {
  const kernels::QuantizedLayout l = kernels::ComputeLayout(p.scaling, m, n);
  QuantizedBytes r;
  r.rowwise_data.assign(l.RowwiseDataBytes(), '\x55');
  r.rowwise_scale.assign(l.RowwiseScaleCount() * 4, '\x55');
  r.columnwise_data.assign(l.ColumnwiseDataBytes(), '\x55');
  r.columnwise_scale.assign(l.ColumnwiseScaleCount() * 4, '\x55');
  kernels::QuantizedBuffers out;
  out.rowwise_data = reinterpret_cast<uint8_t*>(r.rowwise_data.data());
  out.rowwise_scale_inv = reinterpret_cast<float*>(r.rowwise_scale.data());
  out.columnwise_data = reinterpret_cast<uint8_t*>(r.columnwise_data.data());
  out.columnwise_scale_inv = reinterpret_cast<float*>(r.columnwise_scale.data());
  kernels::cpu::QuantizeBlock(input, dtype, m, n, p, out);
  if (!p.rowwise) r.rowwise_data.clear(), r.rowwise_scale.clear();
  if (!p.columnwise) r.columnwise_data.clear(), r.columnwise_scale.clear();
  return r;
}

// A test of server/ops on the CPU device: shm_ (`shm_bytes`, zero-filled) is
// registered as region "r" of regions_ (client shm allowed), and ctx_ points
// at regions_ and device_.
class OpTest : public ::testing::Test {
 protected:
  explicit OpTest(size_t shm_bytes) : shm_(shm_bytes), regions_(RegionOptions()) {}
  static server::tensor::RegionTableOptions RegionOptions() {
    server::tensor::RegionTableOptions o;
    o.allow_client_shm = true;
    return o;
  }
  void SetUp() override {
    ASSERT_TRUE(shm_.ok()) << shm_.error();
    QTX_ASSERT_OK(regions_.RegisterShm("r", shm_.name(), 0, shm_.size()));
    ctx_.regions = &regions_;
    ctx_.device = &device_;
  }

  ShmObject shm_;
  server::tensor::RegionTable regions_;
  server::backend::CpuDevice device_;
  server::ops::OpContext ctx_;
};

}  // namespace qtx::testing

#endif  // QTX_TESTS_SERVER_TESTING_OP_TEST_H_

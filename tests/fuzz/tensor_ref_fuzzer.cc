// libFuzzer target: tensor resolution. The input is a serialized
// qtx.v1.QuantizeOutputs wrapper: a TensorRef (input) and RegionSlice outputs
// (QuantizeRequest's fields), resolved against a region table holding one
// 64 KiB shm region "r". Every resolved view is read end to end and every
// output slice written end to end, so a bounds bug is an ASan report.
#include <fcntl.h>
#include <google/protobuf/stubs/logging.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "qtx/v1/quantizer.pb.h"
#include "server/api/convert.h"
#include "server/tensor/region_table.h"
#include "server/tensor/tensor_ref.h"

namespace {

using namespace qtx::server;  // NOLINT: a fuzz harness

constexpr uint64_t kRegionBytes = 64 * 1024;

tensor::RegionTable* Table() {
  static tensor::RegionTable* table = [] {
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in strings is logged per parse
    const std::string shm = "/qtx-fuzz-tensor-" + std::to_string(::getpid());
    const int fd = ::shm_open(shm.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ::ftruncate(fd, kRegionBytes) != 0) std::abort();
    ::close(fd);
    tensor::RegionTableOptions o;
    o.allow_client_shm = true;
    auto* t = new tensor::RegionTable(o);
    if (!t->RegisterShm("r", shm, 0, kRegionBytes).ok()) std::abort();
    ::shm_unlink(shm.c_str());  // the table keeps its mapping
    return t;
  }();
  return table;
}

volatile uint8_t g_sink;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qtx::v1::QuantizeRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  tensor::ShapeLimits limits;
  limits.max_elements = int64_t{1} << 20;
  auto spec = api::TensorRefFromProto(req.input(), "input");
  if (spec.ok()) {
    auto view = tensor::ResolveInput(*spec, "input", *Table(), limits);
    if (view.ok() && view->data != nullptr) {
      const auto* p = static_cast<const uint8_t*>(view->data);
      uint8_t x = 0;
      for (uint64_t i = 0; i < view->byte_size; ++i) x ^= p[i];
      g_sink = x;
    }
  }
  const qtx::v1::RegionSlice* slices[] = {
      &req.outputs().rowwise_data(), &req.outputs().rowwise_scale_inv(),
      &req.outputs().columnwise_data(), &req.outputs().columnwise_scale_inv()};
  const uint64_t alignments[] = {1, 4, 1, 4};
  for (int i = 0; i < 4; ++i) {
    const tensor::RegionSliceSpec s = api::SliceFromProto(*slices[i]);
    // The size the op would need: the client's own, or a fixed one.
    const uint64_t needed = i % 2 == 0 ? s.size : 4096;
    auto out = tensor::ResolveOutputSlice(s, needed, alignments[i], "outputs", *Table());
    if (out.ok() && out->data != nullptr) {
      auto* p = static_cast<uint8_t*>(out->data);
      for (uint64_t j = 0; j < out->byte_size; ++j) p[j] = static_cast<uint8_t>(j);
    }
  }
  return 0;
}

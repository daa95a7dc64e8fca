// Bad-input table: every RPC of every qtx.v1 service, called with malformed or
// out-of-range requests through the generated stubs against two in-process
// qtxd servers (rank 0 listens on loopback TCP and hosts the rendezvous, rank 1
// joins it). Each case asserts the exact status code and a message substring,
// then that the server still answers a health check and a valid Quantize, and
// that no region stays pinned by the failed call.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/v1/collective.grpc.pb.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/optimizer.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "server/api/server.h"
#include "server/optimizer/checkpoint.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::robustness {
namespace {

using ::qtx::testing::ShmObject;
using ::testing::HasSubstr;
namespace v1 = ::qtx::v1;

constexpr uint64_t kRegionBytes = 64 * 1024;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string TempDir() {
  char tmpl[] = "/tmp/qtx-robust-XXXXXX";
  const char* d = ::mkdtemp(tmpl);
  return d == nullptr ? "" : d;
}

std::string FloatBytes(int64_t count, float value = 1.0f) {
  std::vector<float> v(count, value);
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

v1::TensorRef Inline(v1::DType dtype, std::vector<int64_t> shape, std::string bytes) {
  v1::TensorRef t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(std::move(bytes));
  return t;
}

v1::TensorRef F32(std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return Inline(v1::FLOAT32, std::move(shape), FloatBytes(n));
}

v1::RegionSlice Slice(const std::string& region, uint64_t offset, uint64_t size) {
  v1::RegionSlice s;
  s.set_region(region);
  s.set_offset(offset);
  s.set_size(size);
  return s;
}

v1::TensorRef InRegion(std::vector<int64_t> shape, const std::string& region, uint64_t offset,
                       uint64_t size) {
  v1::TensorRef t;
  t.set_dtype(v1::FLOAT32);
  for (int64_t d : shape) t.add_shape(d);
  *t.mutable_region() = Slice(region, offset, size);
  return t;
}

// One sidecar under test: the in-process server and its stubs.
struct Sidecar {
  std::string dir;
  std::unique_ptr<server::api::QtxServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Quantizer::Stub> quantizer;
  std::unique_ptr<v1::Memory::Stub> memory;
  std::unique_ptr<v1::Collective::Stub> collective;
  std::unique_ptr<v1::Optimizer::Stub> optimizer;
  std::unique_ptr<v1::Rendezvous::Stub> rendezvous;
};

std::unique_ptr<grpc::ClientContext> Ctx(int seconds = 30) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return ctx;
}

// Runs `call` (an RPC on `stub` of the request type) and returns its status.
#define QTX_RPC(sc, svc, method, req)                   \
  ([&]() -> grpc::Status {                              \
    auto ctx_ = Ctx();                                  \
    v1::method##Response resp_;                         \
    return (sc).svc->method(ctx_.get(), (req), &resp_); \
  }())

class BadInputTest;

struct Case {
  std::string name;
  grpc::StatusCode code;
  std::string message;  // substring the status message must contain
  std::function<grpc::Status(BadInputTest&)> call;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class BadInputTest : public ::testing::TestWithParam<Case> {
 public:
  static void SetUpTestSuite() {
    shm_ = new ShmObject(kRegionBytes);
    ASSERT_TRUE(shm_->ok());
    for (int r = 0; r < 2; ++r) {
      Sidecar& sc = sidecars_[r];
      sc.dir = TempDir();
      ASSERT_FALSE(sc.dir.empty());
      server::config::ServerConfig config;
      config.socket_path = sc.dir + "/qtxd.sock";
      config.allow_client_shm = (r == 0);  // rank 1 refuses client shm
      config.threads = 2;
      config.checkpoint_dir = sc.dir + "/ckpt";
      config.max_tensor_elements = int64_t{1} << 24;
      if (r == 0) config.listen_tcp = "127.0.0.1:0";
      QTX_ASSERT_OK_AND_ASSIGN(sc.server, server::api::QtxServer::Create(config));
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(-1);
      args.SetMaxSendMessageSize(-1);
      sc.channel = grpc::CreateCustomChannel("unix:" + config.socket_path,
                                             grpc::InsecureChannelCredentials(), args);
      sc.quantizer = v1::Quantizer::NewStub(sc.channel);
      sc.memory = v1::Memory::NewStub(sc.channel);
      sc.collective = v1::Collective::NewStub(sc.channel);
      sc.optimizer = v1::Optimizer::NewStub(sc.channel);
      sc.rendezvous = v1::Rendezvous::NewStub(sc.channel);
    }
    // A registered shm region on rank 0.
    v1::RegisterRegionRequest reg;
    reg.set_name("r");
    reg.mutable_shm()->set_shm_name(shm_->name());
    reg.mutable_shm()->set_byte_size(kRegionBytes);
    ASSERT_TRUE(QTX_RPC(A(), memory, RegisterRegion, reg).ok());
    // A one-rank group on rank 0, a two-rank group on both.
    ASSERT_TRUE(CreateGroup(0, "g1", 0, 1).ok());
    auto f = std::async(std::launch::async, [] { return CreateGroup(1, "g2", 1, 2); });
    ASSERT_TRUE(CreateGroup(0, "g2", 0, 2).ok());
    ASSERT_TRUE(f.get().ok());
    // An optimizer group "opt" with one parameter w[4, 8], stepped twice and
    // checkpointed once.
    ASSERT_TRUE(QTX_RPC(A(), optimizer, OffloadOptimizerState, ValidOffload("opt")).ok());
    for (int64_t step = 1; step <= 2; ++step) {
      grpc::Status s = QTX_RPC(A(), optimizer, Step, ValidStep("opt", step));
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    v1::SaveCheckpointRequest save;
    save.set_group("opt");
    ASSERT_TRUE(QTX_RPC(A(), optimizer, SaveCheckpoint, save).ok());
  }

  static void TearDownTestSuite() {
    for (Sidecar& sc : sidecars_) {
      if (sc.server) sc.server->Shutdown(absl::Seconds(5));
      sc.server.reset();
      if (!sc.dir.empty()) std::system(("rm -rf '" + sc.dir + "'").c_str());
    }
    delete shm_;
    shm_ = nullptr;
  }

  static Sidecar& A() { return sidecars_[0]; }
  static Sidecar& B() { return sidecars_[1]; }
  static const ShmObject& shm() { return *shm_; }
  static std::string Coordinator() { return absl::StrCat("127.0.0.1:", A().server->tcp_port()); }

  static grpc::Status CreateGroup(int sidecar, const std::string& name, int rank, int world) {
    v1::CreateGroupRequest req;
    req.set_name(name);
    req.set_rank(rank);
    req.set_world_size(world);
    req.set_backend(v1::GLOO);
    req.set_timeout_ms(4000);  // bounds the wrong-sequence case's wait
    if (rank > 0) req.set_coordinator(Coordinator());
    return QTX_RPC(sidecars_[sidecar], collective, CreateGroup, req);
  }

  static grpc::Status DestroyGroup(int sidecar, const std::string& name) {
    v1::DestroyGroupRequest req;
    req.set_name(name);
    return QTX_RPC(sidecars_[sidecar], collective, DestroyGroup, req);
  }

  static v1::OffloadOptimizerStateRequest ValidOffload(const std::string& group) {
    v1::OffloadOptimizerStateRequest req;
    req.set_group(group);
    v1::ParameterInit* p = req.add_parameters();
    p->set_name("w");
    p->add_shape(4);
    p->add_shape(8);
    *p->mutable_master() = F32({4, 8});
    return req;
  }

  static v1::StepRequest ValidStep(const std::string& group, int64_t step) {
    v1::StepRequest req;
    req.set_group(group);
    req.set_step(step);
    v1::Gradient* g = req.add_gradients();
    g->set_name("w");
    *g->mutable_grad() = F32({4, 8});
    return req;
  }

  static v1::QuantizeRequest ValidQuantize() {
    v1::QuantizeRequest req;
    *req.mutable_input() = F32({4, 256});
    return req;
  }

  static v1::DequantizeRequest ValidDequantize() {
    v1::QuantizeResponse q;
    auto ctx = Ctx();
    grpc::Status s = A().quantizer->Quantize(ctx.get(), ValidQuantize(), &q);
    EXPECT_TRUE(s.ok()) << s.error_message();
    v1::DequantizeRequest req;
    *req.mutable_input() = q.result();
    return req;
  }

  // An AllGather on both ranks of a fresh two-rank group; `edit` changes each
  // rank's request. Returns rank 0's status; rank 1's goes to *other.
  static grpc::Status PairAllGather(const std::string& group,
                                    const std::function<void(int, v1::AllGatherRequest*)>& edit,
                                    grpc::Status* other) {
    auto f = std::async(std::launch::async, [&] { return CreateGroup(1, group, 1, 2); });
    grpc::Status c0 = CreateGroup(0, group, 0, 2);
    grpc::Status c1 = f.get();
    if (!c0.ok()) return c0;
    if (!c1.ok()) return c1;
    grpc::Status out[2];
    std::thread t1([&] {
      v1::AllGatherRequest req;
      req.set_group(group);
      *req.mutable_input() = F32({3, 128});
      edit(1, &req);
      out[1] = QTX_RPC(B(), collective, AllGather, req);
    });
    v1::AllGatherRequest req;
    req.set_group(group);
    *req.mutable_input() = F32({5, 128});
    edit(0, &req);
    out[0] = QTX_RPC(A(), collective, AllGather, req);
    t1.join();
    (void)DestroyGroup(0, group);
    (void)DestroyGroup(1, group);
    *other = out[1];
    return out[0];
  }

  // grpc.health.v1.Health/Check through a generic stub; returns the enum.
  static int HealthStatus(Sidecar& sc) {
    grpc::Slice slice(std::string{});
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::GenericStub stub(sc.channel);
    auto ctx = Ctx(10);
    std::promise<grpc::Status> done;
    stub.UnaryCall(ctx.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                   &response, [&done](grpc::Status s) { done.set_value(s); });
    if (!done.get_future().get().ok()) return -1;
    std::vector<grpc::Slice> slices;
    (void)response.Dump(&slices);
    std::string bytes;
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    return (bytes.size() == 2 && bytes[0] == 0x08) ? bytes[1] : 0;
  }

  // Region "r"'s pin count, polled until it is 0 (the server unpins when the
  // reactor is done, which may be just after the client has its answer).
  static uint32_t SettledPins() {
    uint32_t in_use = 0;
    for (int i = 0; i < 200; ++i) {
      v1::ListRegionsResponse resp;
      auto ctx = Ctx();
      if (!A().memory->ListRegions(ctx.get(), v1::ListRegionsRequest(), &resp).ok()) return 999;
      in_use = 0;
      for (const auto& r : resp.regions()) in_use += r.in_use();
      if (in_use == 0) return 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return in_use;
  }

 private:
  static inline Sidecar sidecars_[2];
  static inline ShmObject* shm_ = nullptr;
};

using T = BadInputTest;
constexpr auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
constexpr auto kNotFound = grpc::StatusCode::NOT_FOUND;
constexpr auto kPrecondition = grpc::StatusCode::FAILED_PRECONDITION;
constexpr auto kExists = grpc::StatusCode::ALREADY_EXISTS;
constexpr auto kDataLoss = grpc::StatusCode::DATA_LOSS;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr auto kExhausted = grpc::StatusCode::RESOURCE_EXHAUSTED;
// A build without NCCL does not implement the NCCL backend at all; a CUDA
// build on a host without a GPU cannot use it.
#ifdef QTX_TEST_HAVE_NCCL
constexpr auto kNcclOnCpuCode = grpc::StatusCode::FAILED_PRECONDITION;
#else
constexpr auto kNcclOnCpuCode = grpc::StatusCode::UNIMPLEMENTED;
#endif

// Quantize with `edit` applied to a valid request.
std::function<grpc::Status(T&)> Q(std::function<void(v1::QuantizeRequest*)> edit) {
  return [edit](T&) {
    v1::QuantizeRequest req = T::ValidQuantize();
    edit(&req);
    return QTX_RPC(T::A(), quantizer, Quantize, req);
  };
}
// Dequantize of a columnwise-only Quantize result of [4, 256], edited.
std::function<grpc::Status(T&)> DCol(std::function<void(v1::QuantizedTensor*)> edit) {
  return [edit](T&) {
    v1::QuantizeRequest q = T::ValidQuantize();
    q.mutable_config()->set_rowwise(false);
    q.mutable_config()->set_columnwise(true);
    v1::QuantizeResponse qr;
    auto ctx = Ctx();
    grpc::Status s = T::A().quantizer->Quantize(ctx.get(), q, &qr);
    if (!s.ok()) return s;
    v1::DequantizeRequest req;
    *req.mutable_input() = qr.result();
    edit(req.mutable_input());
    return QTX_RPC(T::A(), quantizer, Dequantize, req);
  };
}
std::function<grpc::Status(T&)> D(std::function<void(v1::DequantizeRequest*)> edit) {
  return [edit](T&) {
    v1::DequantizeRequest req = T::ValidDequantize();
    edit(&req);
    return QTX_RPC(T::A(), quantizer, Dequantize, req);
  };
}
std::function<grpc::Status(T&)> Reg(std::function<void(v1::RegisterRegionRequest*)> edit,
                                    int sidecar = 0) {
  return [edit, sidecar](T&) {
    v1::RegisterRegionRequest req;
    req.set_name("fresh");
    req.mutable_shm()->set_shm_name(T::shm().name());
    req.mutable_shm()->set_byte_size(kRegionBytes);
    edit(&req);
    grpc::Status s = QTX_RPC(sidecar == 0 ? T::A() : T::B(), memory, RegisterRegion, req);
    if (s.ok()) {  // never leave a stray registration behind
      v1::UnregisterRegionRequest un;
      un.set_name(req.name());
      (void)QTX_RPC(sidecar == 0 ? T::A() : T::B(), memory, UnregisterRegion, un);
    }
    return s;
  };
}
// Rendezvous.Set on rank 0's sidecar (which hosts g2's rendezvous).
std::function<grpc::Status(T&)> RSet(std::string key, size_t value_bytes) {
  return [key, value_bytes](T&) {
    v1::RendezvousSetRequest req;
    req.set_key(key);
    req.set_value(std::string(value_bytes, 'v'));
    auto ctx = Ctx();
    v1::RendezvousSetResponse resp;
    return T::A().rendezvous->Set(ctx.get(), req, &resp);
  };
}
std::function<grpc::Status(T&)> CG(std::function<void(v1::CreateGroupRequest*)> edit) {
  return [edit](T&) {
    v1::CreateGroupRequest req;
    req.set_name("fresh");
    req.set_rank(0);
    req.set_world_size(1);
    req.set_backend(v1::GLOO);
    edit(&req);
    grpc::Status s = QTX_RPC(T::A(), collective, CreateGroup, req);
    if (s.ok()) (void)T::DestroyGroup(0, req.name());
    return s;
  };
}
std::function<grpc::Status(T&)> AG(std::function<void(v1::AllGatherRequest*)> edit) {
  return [edit](T&) {
    v1::AllGatherRequest req;
    req.set_group("g1");
    *req.mutable_input() = F32({4, 128});
    // g1's next sequence number.
    v1::ListGroupsResponse groups;
    auto ctx = Ctx();
    (void)T::A().collective->ListGroups(ctx.get(), v1::ListGroupsRequest(), &groups);
    for (const auto& g : groups.groups()) {
      if (g.name() == "g1") req.set_sequence(g.next_sequence());
    }
    edit(&req);
    return QTX_RPC(T::A(), collective, AllGather, req);
  };
}
// A mismatched pair of AllGather calls: both ranks must fail with `code`.
std::function<grpc::Status(T&)> Pair(std::string group,
                                     std::function<void(int, v1::AllGatherRequest*)> edit,
                                     grpc::StatusCode code) {
  return [group, edit, code](T&) {
    grpc::Status other;
    grpc::Status s = T::PairAllGather(group, edit, &other);
    EXPECT_EQ(other.error_code(), code) << "rank 1: " << other.error_message();
    return s;
  };
}
std::function<grpc::Status(T&)> Off(std::function<void(v1::OffloadOptimizerStateRequest*)> edit) {
  return [edit](T&) {
    v1::OffloadOptimizerStateRequest req = T::ValidOffload("fresh");
    edit(&req);
    grpc::Status s = QTX_RPC(T::A(), optimizer, OffloadOptimizerState, req);
    if (s.ok()) {
      v1::ReleaseGroupRequest rel;
      rel.set_group(req.group());
      (void)QTX_RPC(T::A(), optimizer, ReleaseGroup, rel);
    }
    return s;
  };
}
// A Step of "opt" (at step 2) as the next step, edited.
std::function<grpc::Status(T&)> St(std::function<void(v1::StepRequest*)> edit) {
  return [edit](T&) {
    v1::StepRequest req = T::ValidStep("opt", 3);
    edit(&req);
    return QTX_RPC(T::A(), optimizer, Step, req);
  };
}
// Rank 0's checkpoint directory.
std::string CheckpointDir() { return T::A().dir + "/ckpt"; }

// LoadCheckpoint of group `name` after `plant` put something at its path
// (removed again afterwards, as is any group the call created).
std::function<grpc::Status(T&)> LoadPlanted(std::string name,
                                            std::function<int(const std::string& path)> plant) {
  return [name, plant](T&) {
    const std::string path = server::optimizer::CheckpointPath(CheckpointDir(), name);
    if (plant(path) != 0) return grpc::Status(grpc::StatusCode::UNKNOWN, "test setup failed");
    v1::LoadCheckpointRequest req;
    req.set_group(name);
    grpc::Status s = QTX_RPC(T::A(), optimizer, LoadCheckpoint, req);
    ::unlink(path.c_str());
    ::rmdir(path.c_str());
    if (s.ok()) {
      v1::ReleaseGroupRequest rel;
      rel.set_group(name);
      (void)QTX_RPC(T::A(), optimizer, ReleaseGroup, rel);
    }
    return s;
  };
}

// LoadCheckpoint of a copy of "opt"'s checkpoint renamed `name`, edited by
// `edit` and written back with a valid checksum (a hand-edited file).
std::function<grpc::Status(T&)> LoadEdited(
    std::string name, std::function<void(server::optimizer::GroupState*)> edit) {
  return LoadPlanted(name, [name, edit](const std::string&) {
    auto state =
        server::optimizer::ReadCheckpoint(server::optimizer::CheckpointPath(CheckpointDir(), "opt"),
                                          [](uint64_t) { return absl::OkStatus(); });
    if (!state.ok()) return 1;
    state->config.name = name;
    edit(&*state);
    return server::optimizer::WriteCheckpoint(CheckpointDir(), *state).ok() ? 0 : 1;
  });
}

std::function<grpc::Status(T&)> GS(std::function<void(v1::GetStateRequest*)> edit) {
  return [edit](T&) {
    v1::GetStateRequest req;
    req.set_group("opt");
    edit(&req);
    return QTX_RPC(T::A(), optimizer, GetState, req);
  };
}

std::vector<int64_t> Rank(int n) { return std::vector<int64_t>(n, 1); }

std::vector<Case> Cases() {
  const uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();
  const int64_t kBig = int64_t{1} << 40;
  std::vector<Case> c = {
      // ---- Quantizer.Quantize -------------------------------------------------
      {"QuantizeInputMissing", kInvalid, "input: missing",
       Q([](auto* r) { r->clear_input(); })},
      {"QuantizeDTypeUnspecified", kInvalid, "DTYPE_UNSPECIFIED",
       Q([](auto* r) { r->mutable_input()->set_dtype(v1::DTYPE_UNSPECIFIED); })},
      {"QuantizeDTypeUnknownValue", kInvalid, "input.dtype=99: unknown DType",
       Q([](auto* r) { r->mutable_input()->set_dtype(static_cast<v1::DType>(99)); })},
      {"QuantizeDTypeFp8Input", kInvalid, "Quantize accepts FLOAT32, BFLOAT16 or FLOAT16",
       Q([](auto* r) { *r->mutable_input() = Inline(v1::FLOAT8_E4M3, {4, 256}, std::string(1024, 0)); })},
      {"QuantizeInlineTooFewBytes", kInvalid, "inline_data",
       Q([](auto* r) { r->mutable_input()->mutable_inline_data()->resize(4 * 256 * 4 - 1); })},
      {"QuantizeInlineTooManyBytes", kInvalid, "inline_data",
       Q([](auto* r) { r->mutable_input()->mutable_inline_data()->append(4, '\0'); })},
      {"QuantizeNegativeDim", kInvalid, "input.shape[0]=-4: dims must be >= 0",
       Q([](auto* r) { r->mutable_input()->set_shape(0, -4); })},
      {"QuantizeRankZero", kInvalid, "rank 0",
       Q([](auto* r) { *r->mutable_input() = Inline(v1::FLOAT32, {}, FloatBytes(1)); })},
      {"QuantizeRankTooHigh", kInvalid, "rank",
       Q([](auto* r) { *r->mutable_input() = Inline(v1::FLOAT32, Rank(64), FloatBytes(1)); })},
      {"QuantizeDimOverLimit", kInvalid, "input.shape[0]=1099511627776: exceeds the element limit",
       Q([kBig](auto* r) { *r->mutable_input() = Inline(v1::FLOAT32, {kBig, kBig}, ""); })},
      {"QuantizeElementCountOverflow", kInvalid, "the limit is 16777216",
       Q([](auto* r) {
         const int64_t d = int64_t{1} << 23;  // each dim under the limit, product 2^69
         *r->mutable_input() = Inline(v1::FLOAT32, {d, d, d}, "");
       })},
      {"QuantizeTooManyElements", kInvalid, "33554432 elements, the limit is 16777216",
       Q([](auto* r) { *r->mutable_input() = Inline(v1::FLOAT32, {1 << 13, 1 << 12}, ""); })},
      {"QuantizeHugeDimZeroOther", kInvalid, "input.shape[1]=1099511627776: exceeds the element limit",
       Q([kBig](auto* r) { *r->mutable_input() = Inline(v1::FLOAT32, {0, kBig}, "xxxx"); })},
      {"QuantizeUnknownScalingMode", kInvalid, "scaling_mode=7",
       Q([](auto* r) { r->mutable_config()->set_scaling_mode(static_cast<v1::ScalingMode>(7)); })},
      {"QuantizeUnknownFp8Format", kInvalid, "format=9: unknown Fp8Format",
       Q([](auto* r) { r->mutable_config()->set_format(static_cast<v1::Fp8Format>(9)); })},
      {"QuantizeNoUsage", kInvalid, "rowwise",
       Q([](auto* r) {
         r->mutable_config()->set_rowwise(false);
         r->mutable_config()->set_columnwise(false);
       })},
      {"QuantizeEpsilonNaN", kInvalid, "amax_epsilon",
       Q([](auto* r) { r->mutable_config()->set_amax_epsilon(std::nanf("")); })},
      {"QuantizeEpsilonNegative", kInvalid, "amax_epsilon",
       Q([](auto* r) { r->mutable_config()->set_amax_epsilon(-1.0f); })},
      {"QuantizeEpsilonInfinite", kInvalid, "amax_epsilon",
       Q([](auto* r) { r->mutable_config()->set_amax_epsilon(INFINITY); })},
      {"QuantizeNoData", kInvalid, "no data",
       Q([](auto* r) { r->mutable_input()->clear_inline_data(); })},
      {"QuantizeUnknownRegion", kNotFound, "'nosuch' is not registered",
       Q([](auto* r) { *r->mutable_input() = InRegion({4, 256}, "nosuch", 0, 4096); })},
      {"QuantizeEmptyRegionName", kNotFound, "input.region: region '' is not registered",
       Q([](auto* r) { *r->mutable_input() = InRegion({4, 256}, "", 0, 4096); })},
      {"QuantizeOffsetPastEnd", kInvalid, "exceeds",
       Q([](auto* r) { *r->mutable_input() = InRegion({4, 256}, "r", kRegionBytes, 4096); })},
      {"QuantizeOffsetPlusSizePastEnd", kInvalid, "exceeds",
       Q([](auto* r) { *r->mutable_input() = InRegion({4, 256}, "r", kRegionBytes - 4095, 4096); })},
      {"QuantizeOffsetPlusSizeOverflow", kInvalid, "r",
       Q([kMaxU64](auto* r) { *r->mutable_input() = InRegion({4, 256}, "r", kMaxU64 - 100, 4096); })},
      // Issue 18 item 15: alignment counts from the start of the shm object,
      // not of the region: a region registered at shm offset 2 puts slice
      // offset 0 at a misaligned address.
      {"QuantizeSliceMisalignedInShmObject", kInvalid,
       "must start at multiples of the element size counted from the start of the shm object",
       [](T&) {
         v1::RegisterRegionRequest reg;
         reg.set_name("mis");
         reg.mutable_shm()->set_shm_name(T::shm().name());
         reg.mutable_shm()->set_offset(2);
         reg.mutable_shm()->set_byte_size(8192);
         grpc::Status r = QTX_RPC(T::A(), memory, RegisterRegion, reg);
         if (!r.ok()) return r;
         v1::QuantizeRequest req = T::ValidQuantize();
         *req.mutable_input() = InRegion({4, 256}, "mis", 0, 4096);
         grpc::Status s = QTX_RPC(T::A(), quantizer, Quantize, req);
         v1::UnregisterRegionRequest un;
         un.set_name("mis");
         (void)QTX_RPC(T::A(), memory, UnregisterRegion, un);
         return s;
       }},
      {"QuantizeSliceSizeMismatch", kInvalid, "size=4000: expected 4096",
       Q([](auto* r) { *r->mutable_input() = InRegion({4, 256}, "r", 0, 4000); })},
      {"QuantizeOutputUnknownRegion", kNotFound, "not registered",
       Q([](auto* r) { *r->mutable_outputs()->mutable_rowwise_data() = Slice("nosuch", 0, 1024); })},
      {"QuantizeOutputWrongSize", kInvalid, "rowwise_data",
       Q([](auto* r) { *r->mutable_outputs()->mutable_rowwise_data() = Slice("r", 0, 1000); })},
      {"QuantizeOutputPastEnd", kInvalid, "exceeds",
       Q([](auto* r) { *r->mutable_outputs()->mutable_rowwise_data() = Slice("r", kRegionBytes - 512, 1024); })},
      {"QuantizeOutputOverlapsInput", kInvalid, "overlap",
       Q([](auto* r) {
         *r->mutable_input() = InRegion({4, 256}, "r", 0, 4096);
         *r->mutable_outputs()->mutable_rowwise_data() = Slice("r", 2048, 1024);
       })},
      {"QuantizeCudaEventWrongLength", kInvalid, "must be exactly 64",
       Q([](auto* r) { r->mutable_cuda_events()->set_wait_event(std::string(3, 'x')); })},
      {"QuantizeCudaEventOnCpu", kPrecondition, "",
       Q([](auto* r) { r->mutable_cuda_events()->set_signal_event(std::string(64, 'x')); })},
      // ---- Quantizer.Dequantize -----------------------------------------------
      {"DequantizeInputMissing", kInvalid, "input: missing",
       D([](auto* r) { r->clear_input(); })},
      {"DequantizeUnknownOutputDType", kInvalid, "output_dtype=42",
       D([](auto* r) { r->set_output_dtype(static_cast<v1::DType>(42)); })},
      {"DequantizeFp8OutputDType", kInvalid, "output_dtype=FLOAT8_E4M3: must be FLOAT32",
       D([](auto* r) { r->set_output_dtype(v1::FLOAT8_E4M3); })},
      {"DequantizeDataWrongBytes", kInvalid, "rowwise_data",
       D([](auto* r) {
         r->mutable_input()->mutable_rowwise_data()->mutable_inline_data()->resize(7);
       })},
      {"DequantizeScaleWrongShape", kInvalid, "rowwise_scale_inv",
       D([](auto* r) { r->mutable_input()->mutable_rowwise_scale_inv()->set_shape(0, 3); })},
      {"DequantizeNegativeShape", kInvalid, "shape",
       D([](auto* r) { r->mutable_input()->set_shape(0, -1); })},
      {"DequantizeShapeDisagreesWithData", kInvalid, "rowwise_data",
       D([](auto* r) { r->mutable_input()->set_shape(0, 8); })},
      {"DequantizeDataDTypeFloat32", kInvalid, "rowwise_data.dtype",
       D([](auto* r) { r->mutable_input()->mutable_rowwise_data()->set_dtype(v1::FLOAT32); })},
      {"DequantizeNoData", kInvalid, "",
       D([](auto* r) {
         r->mutable_input()->clear_rowwise_data();
         r->mutable_input()->clear_rowwise_scale_inv();
       })},
      {"DequantizeColumnwiseDataTransposed", kInvalid,
       "input.columnwise_data.shape=[4, 256]: expected [256, 4]",
       DCol([](v1::QuantizedTensor* t) {
         t->mutable_columnwise_data()->set_shape(0, 4);
         t->mutable_columnwise_data()->set_shape(1, 256);
       })},
      {"DequantizeColumnwiseScaleTransposed", kInvalid,
       "input.columnwise_scale_inv.shape=[256, 1]: expected [1, 256]",
       DCol([](v1::QuantizedTensor* t) {
         t->mutable_columnwise_scale_inv()->set_shape(0, 256);
         t->mutable_columnwise_scale_inv()->set_shape(1, 1);
       })},
      {"DequantizeUnknownScalingMode", kInvalid, "scaling_mode=5",
       D([](auto* r) {
         r->mutable_input()->mutable_config()->set_scaling_mode(static_cast<v1::ScalingMode>(5));
       })},
      {"DequantizeOutputUnknownRegion", kNotFound, "not registered",
       D([](auto* r) { *r->mutable_output() = Slice("nosuch", 0, 4096); })},
      {"DequantizeOutputWrongSize", kInvalid, "expected 4096",
       D([](auto* r) { *r->mutable_output() = Slice("r", 0, 4092); })},
      // ---- Memory ---------------------------------------------------------------
      {"RegisterEmptyName", kInvalid, "name", Reg([](auto* r) { r->set_name(""); })},
      {"RegisterBadCharacter", kInvalid, "is not one of [A-Za-z0-9_.:/-]",
       Reg([](auto* r) { r->set_name("bad name"); })},
      {"RegisterNameTooLong", kInvalid, "name", Reg([](auto* r) { r->set_name(std::string(200, 'n')); })},
      {"RegisterKindUnset", kInvalid, "kind: set shm, cuda_ipc or cuda_vmm",
       Reg([](auto* r) { r->clear_kind(); })},
      {"RegisterShmZeroBytes", kInvalid, "shm.byte_size=0: must be > 0",
       Reg([](auto* r) { r->mutable_shm()->set_byte_size(0); })},
      {"RegisterShmNoSuchObject", kNotFound, "no such shared-memory object",
       Reg([](auto* r) { r->mutable_shm()->set_shm_name("/qtx-robust-missing-object"); })},
      {"RegisterShmBadObjectName", kInvalid, "shm_name",
       Reg([](auto* r) { r->mutable_shm()->set_shm_name("../etc/passwd"); })},
      {"RegisterShmLargerThanObject", kInvalid, "shm",
       Reg([](auto* r) { r->mutable_shm()->set_byte_size(kRegionBytes + 1); })},
      {"RegisterShmOffsetPastEnd", kInvalid, "shm",
       Reg([](auto* r) {
         r->mutable_shm()->set_offset(kRegionBytes);
         r->mutable_shm()->set_byte_size(1);
       })},
      {"RegisterShmOffsetOverflow", kInvalid, "shm",
       Reg([kMaxU64](auto* r) {
         r->mutable_shm()->set_offset(kMaxU64 - 10);
         r->mutable_shm()->set_byte_size(100);
       })},
      {"RegisterDuplicateName", kExists, "'r'", Reg([](auto* r) { r->set_name("r"); })},
      {"RegisterShmRefusedByFlag", kPrecondition, "allow_client_shm",
       Reg([](auto*) {}, /*sidecar=*/1)},
      {"RegisterIpcHandleTooShort", kInvalid, "64",
       Reg([](auto* r) {
         r->mutable_cuda_ipc()->set_ipc_handle(std::string(10, 'h'));
         r->mutable_cuda_ipc()->set_byte_size(1024);
       })},
      {"RegisterIpcHandleTooLong", kInvalid, "64",
       Reg([](auto* r) {
         r->mutable_cuda_ipc()->set_ipc_handle(std::string(65, 'h'));
         r->mutable_cuda_ipc()->set_byte_size(1024);
       })},
      {"RegisterIpcNegativeDevice", kInvalid, "cuda_ipc.device_id=-1: must be >= 0",
       Reg([](auto* r) {
         r->mutable_cuda_ipc()->set_ipc_handle(std::string(64, 'h'));
         r->mutable_cuda_ipc()->set_device_id(-1);
         r->mutable_cuda_ipc()->set_byte_size(1024);
       })},
      {"RegisterIpcZeroBytes", kInvalid, "cuda_ipc.byte_size=0: must be > 0",
       Reg([](auto* r) { r->mutable_cuda_ipc()->set_ipc_handle(std::string(64, 'h')); })},
      {"RegisterIpcOnCpuDevice", kPrecondition, "'fresh'",
       Reg([](auto* r) {
         r->mutable_cuda_ipc()->set_ipc_handle(std::string(64, 'h'));
         r->mutable_cuda_ipc()->set_byte_size(1024);
       })},
      {"UnregisterUnknown", kNotFound, "'nosuch' is not registered",
       [](T&) {
         v1::UnregisterRegionRequest req;
         req.set_name("nosuch");
         return QTX_RPC(T::A(), memory, UnregisterRegion, req);
       }},
      {"UnregisterEmptyName", kNotFound, "region '' is not registered",
       [](T&) {
         v1::UnregisterRegionRequest req;
         return QTX_RPC(T::A(), memory, UnregisterRegion, req);
       }},
      // ---- Collective -----------------------------------------------------------
      {"CreateGroupEmptyName", kInvalid, "name: must not be empty",
       CG([](auto* r) { r->set_name(""); })},
      {"CreateGroupBadName", kInvalid, "only letters, digits",
       CG([](auto* r) { r->set_name("a/b"); })},
      {"CreateGroupWorldZero", kInvalid, "world_size=0: must be >= 1",
       CG([](auto* r) { r->set_world_size(0); })},
      {"CreateGroupWorldNegative", kInvalid, "world_size=-3",
       CG([](auto* r) { r->set_world_size(-3); })},
      {"CreateGroupRankTooLarge", kInvalid, "rank=2: must be in [0, world_size=2)",
       CG([](auto* r) {
         r->set_rank(2);
         r->set_world_size(2);
         r->set_coordinator("127.0.0.1:1");
       })},
      {"CreateGroupRankNegative", kInvalid, "rank=-1",
       CG([](auto* r) { r->set_rank(-1); })},
      {"CreateGroupUnknownBackend", kInvalid, "backend=9: must be GLOO or NCCL",
       CG([](auto* r) { r->set_backend(static_cast<v1::CommBackend>(9)); })},
      {"CreateGroupNcclOnCpu", kNcclOnCpuCode, "NCCL",
       CG([](auto* r) { r->set_backend(v1::NCCL); })},
      {"CreateGroupNoCoordinator", kInvalid, "coordinator: empty on rank 1",
       CG([](auto* r) {
         r->set_rank(1);
         r->set_world_size(2);
       })},
      {"CreateGroupDuplicate", kExists, "group 'g1' already exists",
       CG([](auto* r) { r->set_name("g1"); })},
      {"CreateGroupTimeoutTooLong", kInvalid, "timeout=",
       CG([](auto* r) { r->set_timeout_ms(0xFFFFFFFFu); })},
      {"CreateGroupWorldTooLarge", kInvalid, "world_size=1025: at most 1024 ranks per group",
       CG([](auto* r) { r->set_world_size(1025); })},
      {"CreateGroupWorldHuge", kInvalid, "world_size=2147483647: at most 1024 ranks per group",
       CG([](auto* r) { r->set_world_size(2147483647); })},
      {"RendezvousSetUnknownGroup", kPrecondition, "no group is forming under it",
       RSet("qtx/group/nosuch/x", 10)},
      {"RendezvousSetOutsideGroups", kPrecondition, "no group is forming under it",
       RSet("junk", 10)},
      {"RendezvousSetKeyTooLong", kInvalid, "exceeds the limit of 256 bytes",
       RSet("qtx/group/g2/" + std::string(300, 'k'), 10)},
      {"RendezvousSetValueTooLarge", kExhausted, "exceeds the limit of 262144 bytes",
       RSet("qtx/group/g2/big", 300 << 10)},
      {"RendezvousSetOverGroupBudget", kExhausted, "group namespace 'qtx/group/g2/'",
       RSet("qtx/group/g2/fill", 200 << 10)},
      {"RendezvousGetTooManyKeys", kInvalid, "65 keys exceed the limit of 64",
       [](T&) {
         v1::RendezvousGetRequest req;
         for (int i = 0; i < 65; ++i) req.add_keys(absl::StrCat("qtx/group/g2/k", i));
         auto ctx = Ctx();
         v1::RendezvousGetResponse resp;
         return T::A().rendezvous->Get(ctx.get(), req, &resp);
       }},
      {"AllGatherUnknownGroup", kNotFound, "nosuch",
       AG([](auto* r) { r->set_group("nosuch"); })},
      {"AllGatherWrongSequence", kPrecondition, "sequence",
       AG([](auto* r) { r->set_sequence(r->sequence() + 5); })},
      {"AllGatherInputMissing", kInvalid, "input: missing", AG([](auto* r) { r->clear_input(); })},
      {"AllGatherUnknownMode", kInvalid, "mode=7: must be EXACT_FP8 or GATHER_HIGH_PRECISION",
       AG([](auto* r) { r->set_mode(static_cast<v1::AllGatherMode>(7)); })},
      {"AllGatherFp8Input", kInvalid, "input.dtype",
       AG([](auto* r) { *r->mutable_input() = Inline(v1::UINT8, {4, 128}, std::string(512, 0)); })},
      {"AllGatherWrongBytes", kInvalid, "inline_data",
       AG([](auto* r) { r->mutable_input()->mutable_inline_data()->resize(100); })},
      {"AllGatherUnknownFormat", kInvalid, "unknown Fp8Format",
       AG([](auto* r) { r->mutable_config()->set_format(static_cast<v1::Fp8Format>(3)); })},
      {"AllGatherCudaEventWrongLength", kInvalid, "cuda_events.wait_event: 3 bytes",
       AG([](auto* r) { r->mutable_cuda_events()->set_wait_event(std::string(3, 'x')); })},
      {"AllGatherCudaEventOnCpu", kPrecondition, "--device=cuda:N",
       AG([](auto* r) { r->mutable_cuda_events()->set_signal_event(std::string(64, 'x')); })},
      {"AllGatherUnknownRegion", kNotFound, "not registered",
       AG([](auto* r) { *r->mutable_input() = InRegion({4, 128}, "nosuch", 0, 2048); })},
      {"AllGatherMismatchedN", kInvalid, "",
       Pair("mm-n", [](int rank, v1::AllGatherRequest* r) {
         if (rank == 1) *r->mutable_input() = F32({3, 256});
       }, kInvalid)},
      {"AllGatherMismatchedMode", kInvalid, "mode",
       Pair("mm-mode", [](int rank, v1::AllGatherRequest* r) {
         r->set_mode(rank == 0 ? v1::EXACT_FP8 : v1::GATHER_HIGH_PRECISION);
       }, kInvalid)},
      {"AllGatherMismatchedScaling", kInvalid, "",
       Pair("mm-scal", [](int rank, v1::AllGatherRequest* r) {
         if (rank == 1) r->mutable_config()->set_scaling_mode(v1::BLOCK_2D);
       }, kInvalid)},
      {"DestroyGroupUnknown", kNotFound, "nosuch",
       [](T&) {
         v1::DestroyGroupRequest req;
         req.set_name("nosuch");
         return QTX_RPC(T::A(), collective, DestroyGroup, req);
       }},
      // ---- Optimizer.OffloadOptimizerState ------------------------------------
      {"OffloadEmptyGroupName", kInvalid, "must be 1..128 characters",
       Off([](auto* r) { r->set_group(""); })},
      {"OffloadBadGroupName", kInvalid, "not allowed",
       Off([](auto* r) { r->set_group("a/../b"); })},
      {"OffloadDotGroupName", kInvalid, "must not start with '.'",
       Off([](auto* r) { r->set_group(".hidden"); })},
      {"OffloadNoParameters", kInvalid, "parameters: empty",
       Off([](auto* r) { r->clear_parameters(); })},
      {"OffloadLrNaN", kInvalid, "hyper_params.lr=nan",
       Off([](auto* r) { r->mutable_hyper_params()->set_lr(kNaN); })},
      {"OffloadLrInf", kInvalid, "hyper_params.lr=inf",
       Off([](auto* r) { r->mutable_hyper_params()->set_lr(kInf); })},
      {"OffloadLrNegative", kInvalid, "hyper_params.lr=-1",
       Off([](auto* r) { r->mutable_hyper_params()->set_lr(-1); })},
      {"OffloadBeta1One", kInvalid, "hyper_params.beta1=1: must be in [0, 1)",
       Off([](auto* r) { r->mutable_hyper_params()->set_beta1(1.0); })},
      {"OffloadBeta2NaN", kInvalid, "hyper_params.beta2=nan",
       Off([](auto* r) { r->mutable_hyper_params()->set_beta2(kNaN); })},
      {"OffloadEpsInf", kInvalid, "hyper_params.eps=inf",
       Off([](auto* r) { r->mutable_hyper_params()->set_eps(kInf); })},
      {"OffloadWeightDecayNaN", kInvalid, "hyper_params.weight_decay=nan",
       Off([](auto* r) { r->mutable_hyper_params()->set_weight_decay(kNaN); })},
      {"OffloadUnknownMomentDType", kInvalid, "moment_dtype=9: unknown MomentDType",
       Off([](auto* r) { r->set_moment_dtype(static_cast<v1::MomentDType>(9)); })},
      {"OffloadUnknownOutputFormat", kInvalid, "output.format=7: unknown ParameterFormat",
       Off([](auto* r) { r->mutable_output()->set_format(static_cast<v1::ParameterFormat>(7)); })},
      {"OffloadUnknownOutputScaling", kInvalid, "output.fp8.scaling_mode",
       Off([](auto* r) {
         r->mutable_output()->mutable_fp8()->set_scaling_mode(static_cast<v1::ScalingMode>(4));
       })},
      {"OffloadNegativeStep", kInvalid, "step=-1: must be >= 0",
       Off([](auto* r) { r->set_step(-1); })},
      // Issue 18 item 8: the step counter must never wrap.
      {"OffloadStepInt64Max", kInvalid,
       "step=9223372036854775807: must be at most 9007199254740992",
       Off([](auto* r) { r->set_step(kInt64Max); })},
      {"OffloadStepPastTwoTo53", kInvalid, "step=9007199254740993: must be at most",
       Off([](auto* r) { r->set_step((int64_t{1} << 53) + 1); })},
      {"OffloadMasterMissing", kInvalid, "parameters[0].master: missing",
       Off([](auto* r) { r->mutable_parameters(0)->clear_master(); })},
      {"OffloadMasterWrongBytes", kInvalid, "parameters[0].master",
       Off([](auto* r) {
         r->mutable_parameters(0)->mutable_master()->mutable_inline_data()->resize(12);
       })},
      {"OffloadMasterFp8", kInvalid, "parameters[0].master.dtype",
       Off([](auto* r) {
         *r->mutable_parameters(0)->mutable_master() = Inline(v1::UINT8, {4, 8}, std::string(32, 0));
       })},
      {"OffloadMomentDTypesDiffer", kInvalid, "exp_avg is FLOAT32 but exp_avg_sq is BFLOAT16",
       Off([](auto* r) {
         *r->mutable_parameters(0)->mutable_exp_avg() = F32({4, 8});
         *r->mutable_parameters(0)->mutable_exp_avg_sq() = Inline(v1::BFLOAT16, {4, 8}, std::string(64, 0));
       })},
      {"OffloadExpAvgWithoutExpAvgSq", kInvalid, "give both exp_avg and exp_avg_sq or neither",
       Off([](auto* r) { *r->mutable_parameters(0)->mutable_exp_avg() = F32({4, 8}); })},
      {"OffloadShapeDisagrees", kInvalid, "parameters[0]",
       Off([](auto* r) { r->mutable_parameters(0)->set_shape(1, 9); })},
      {"OffloadNegativeShape", kInvalid, "parameters[0]",
       Off([](auto* r) { r->mutable_parameters(0)->set_shape(0, -4); })},
      {"OffloadShapeOverflow", kInvalid, "parameters[0]",
       Off([kBig](auto* r) {
         r->mutable_parameters(0)->set_shape(0, kBig);
         r->mutable_parameters(0)->set_shape(1, kBig);
       })},
      {"OffloadEmptyParameterName", kInvalid, "parameters[0]",
       Off([](auto* r) { r->mutable_parameters(0)->set_name(""); })},
      {"OffloadDuplicateParameterName", kInvalid, "'w'",
       Off([](auto* r) { *r->add_parameters() = r->parameters(0); })},
      {"OffloadExpAvgWrongBytes", kInvalid, "parameters[0].exp_avg",
       Off([](auto* r) {
         *r->mutable_parameters(0)->mutable_exp_avg() = F32({4, 7});
         *r->mutable_parameters(0)->mutable_exp_avg_sq() = F32({4, 8});
       })},
      {"OffloadMasterUnknownRegion", kNotFound, "not registered",
       Off([](auto* r) {
         *r->mutable_parameters(0)->mutable_master() = InRegion({4, 8}, "nosuch", 0, 128);
       })},
      {"OffloadExistingGroup", kExists, "'opt'", Off([](auto* r) { r->set_group("opt"); })},
      // ---- Optimizer.Step --------------------------------------------------------
      {"StepUnknownGroup", kNotFound, "optimizer group 'nosuch' does not exist",
       St([](auto* r) { r->set_group("nosuch"); })},
      {"StepStale", kPrecondition, "is at step 2: the next step is 3",
       St([](auto* r) { r->set_step(1); })},
      {"StepFuture", kPrecondition, "got step 7", St([](auto* r) { r->set_step(7); })},
      {"StepNegative", kPrecondition, "got step -1", St([](auto* r) { r->set_step(-1); })},
      {"StepInt64Max", kInvalid, "step=9223372036854775807: must be at most 9007199254740992",
       St([](auto* r) { r->set_step(kInt64Max); })},
      {"StepLrNaN", kInvalid, "lr=nan: must be finite", St([](auto* r) { r->set_lr(kNaN); })},
      {"StepLrNegative", kInvalid, "lr=-0.5", St([](auto* r) { r->set_lr(-0.5); })},
      {"StepMaxGradNormZero", kInvalid, "max_grad_norm=0: must be finite and > 0",
       St([](auto* r) { r->set_max_grad_norm(0); })},
      {"StepMaxGradNormInf", kInvalid, "max_grad_norm=inf",
       St([](auto* r) { r->set_max_grad_norm(kInf); })},
      {"StepUnknownParameter", kInvalid, "'nope'",
       St([](auto* r) { r->mutable_gradients(0)->set_name("nope"); })},
      {"StepMissingGradient", kInvalid, "'w'", St([](auto* r) { r->clear_gradients(); })},
      {"StepDuplicateGradient", kInvalid, "'w'",
       St([](auto* r) { *r->add_gradients() = r->gradients(0); })},
      {"StepGradientWrongShape", kInvalid, "gradients['w'].grad.shape=[8,4]: must equal the parameter's shape [4,8]",
       St([](auto* r) { *r->mutable_gradients(0)->mutable_grad() = F32({8, 4}); })},
      {"StepGradientWrongBytes", kInvalid, "gradients[0]",
       St([](auto* r) { r->mutable_gradients(0)->mutable_grad()->mutable_inline_data()->resize(3); })},
      {"StepGradientUnknownDType", kInvalid, "unknown DType",
       St([](auto* r) { r->mutable_gradients(0)->mutable_grad()->set_dtype(static_cast<v1::DType>(77)); })},
      {"StepGradientOffsetOverflow", kInvalid, "r",
       St([kMaxU64](auto* r) {
         *r->mutable_gradients(0)->mutable_grad() = InRegion({4, 8}, "r", kMaxU64 - 64, 128);
       })},
      {"StepDestinationUnknownRegion", kNotFound, "not registered",
       St([](auto* r) {
         v1::ParameterDestination* d = r->add_destinations();
         d->set_name("w");
         *d->mutable_fp8()->mutable_rowwise_data() = Slice("nosuch", 0, 32);
       })},
      {"StepDestinationUnknownParameter", kInvalid, "'zz'",
       St([](auto* r) {
         v1::ParameterDestination* d = r->add_destinations();
         d->set_name("zz");
         *d->mutable_fp8()->mutable_rowwise_data() = Slice("r", 0, 32);
       })},
      {"StepDestinationWrongSize", kInvalid, "expected 32",
       St([](auto* r) {
         v1::ParameterDestination* d = r->add_destinations();
         d->set_name("w");
         *d->mutable_fp8()->mutable_rowwise_data() = Slice("r", 0, 31);
       })},
      {"StepDestinationsOverlap", kInvalid, "destinations may not share bytes",
       St([](auto* r) {
         v1::ParameterDestination* d = r->add_destinations();
         d->set_name("w");
         *d->mutable_fp8()->mutable_rowwise_data() = Slice("r", 0, 32);
         *d->mutable_fp8()->mutable_columnwise_data() = Slice("r", 16, 32);
       })},
      {"StepDestinationsOverlapAcrossFields", kInvalid, "destinations may not share bytes",
       St([](auto* r) {
         v1::ParameterDestination* d = r->add_destinations();
         d->set_name("w");
         *d->mutable_fp8()->mutable_rowwise_data() = Slice("r", 1024, 32);
         *d->mutable_fp8()->mutable_rowwise_scale_inv() = Slice("r", 1040, 16);
       })},
      // ---- Optimizer.GetState / checkpoints / release ----------------------------
      {"GetStateUnknownGroup", kNotFound, "'nosuch' does not exist",
       GS([](auto* r) { r->set_group("nosuch"); })},
      {"GetStateUnknownParameter", kNotFound, "'nope'",
       GS([](auto* r) { r->add_names("nope"); })},
      {"GetStateDestinationWrongSize", kInvalid, "expected 128",
       GS([](auto* r) {
         v1::StateDestination* d = r->add_destinations();
         d->set_name("w");
         *d->mutable_master() = Slice("r", 0, 64);
       })},
      {"GetStateDestinationPastEnd", kInvalid, "exceeds",
       GS([](auto* r) {
         v1::StateDestination* d = r->add_destinations();
         d->set_name("w");
         *d->mutable_master() = Slice("r", kRegionBytes - 64, 128);
       })},
      {"GetStateDuplicateName", kInvalid, "names[1]='w': given twice",
       GS([](auto* r) {
         r->add_names("w");
         r->add_names("w");
       })},
      {"GetStateDestinationsOverlap", kInvalid, "destinations may not share bytes",
       GS([](auto* r) {
         r->set_include_moments(true);
         v1::StateDestination* d = r->add_destinations();
         d->set_name("w");
         *d->mutable_master() = Slice("r", 0, 128);
         *d->mutable_exp_avg() = Slice("r", 64, 128);
       })},
      {"SaveCheckpointUnknownGroup", kNotFound, "'nosuch'",
       [](T&) {
         v1::SaveCheckpointRequest req;
         req.set_group("nosuch");
         return QTX_RPC(T::A(), optimizer, SaveCheckpoint, req);
       }},
      {"LoadCheckpointUnknownGroup", kNotFound, "nosuch",
       [](T&) {
         v1::LoadCheckpointRequest req;
         req.set_group("nosuch");
         return QTX_RPC(T::A(), optimizer, LoadCheckpoint, req);
       }},
      {"LoadCheckpointDotDotGroupName", kInvalid, "must not start with '.'",
       [](T&) {
         v1::LoadCheckpointRequest req;
         req.set_group("../../etc");
         return QTX_RPC(T::A(), optimizer, LoadCheckpoint, req);
       }},
      {"LoadCheckpointSlashGroupName", kInvalid, "not allowed",
       [](T&) {
         v1::LoadCheckpointRequest req;
         req.set_group("a/b");
         return QTX_RPC(T::A(), optimizer, LoadCheckpoint, req);
       }},
      {"LoadCheckpointNoPrevious", kNotFound, "",
       [](T&) {
         v1::LoadCheckpointRequest req;
         req.set_group("opt");
         req.set_previous(true);
         return QTX_RPC(T::A(), optimizer, LoadCheckpoint, req);
       }},
      // Issue 18 item 5: only regular files are read; a FIFO used to block
      // the worker (and startup) forever.
      {"LoadCheckpointFifo", kPrecondition, "is a FIFO, not a regular file",
       LoadPlanted("fifo", [](const std::string& p) { return ::mkfifo(p.c_str(), 0600); })},
      {"LoadCheckpointSymlink", kPrecondition, "is a symbolic link",
       LoadPlanted("lnk", [](const std::string& p) { return ::symlink("opt.qtxopt", p.c_str()); })},
      {"LoadCheckpointDirectory", kPrecondition, "is a directory",
       LoadPlanted("dir", [](const std::string& p) { return ::mkdir(p.c_str(), 0700); })},
      // Issue 18 item 6: a matching checksum is not enough; every loaded value
      // is checked as OffloadOptimizerState checks it.
      {"LoadCheckpointEditedLrNaN", kDataLoss, "impossible value: hyper_params.lr=nan",
       LoadEdited("ed-lr", [](auto* s) { s->config.hyper.lr = kNaN; })},
      {"LoadCheckpointEditedNegativeEps", kDataLoss, "hyper_params.eps=-1",
       LoadEdited("ed-eps", [](auto* s) { s->config.hyper.eps = -1; })},
      {"LoadCheckpointEditedBeta1One", kDataLoss, "hyper_params.beta1=1: must be in [0, 1)",
       LoadEdited("ed-b1", [](auto* s) { s->config.hyper.beta1 = 1.0; })},
      {"LoadCheckpointEditedBeta2Negative", kDataLoss, "hyper_params.beta2=-0.1",
       LoadEdited("ed-b2", [](auto* s) { s->config.hyper.beta2 = -0.1; })},
      {"LoadCheckpointEditedWeightDecayInf", kDataLoss, "hyper_params.weight_decay=inf",
       LoadEdited("ed-wd", [](auto* s) { s->config.hyper.weight_decay = kInf; })},
      {"LoadCheckpointEditedStepInt64Max", kDataLoss, "step=9223372036854775807",
       LoadEdited("ed-step", [](auto* s) { s->config.step = kInt64Max; })},
      {"LoadCheckpointEditedUpdateCountPastStep", kDataLoss, "update_count=7: must be 0..step",
       LoadEdited("ed-uc", [](auto* s) { s->update_count = 7; })},
      {"LoadCheckpointEditedAmaxEpsilonNaN", kDataLoss, "output.fp8.amax_epsilon=nan",
       LoadEdited("ed-amax",
                  [](auto* s) { s->config.output.quant.amax_epsilon = static_cast<float>(kNaN); })},
      // Issue 18 item 4: a link planted under the temp name the old code used
      // (<group>.qtxopt.tmp.<pid>) is neither followed nor replaced.
      {"SaveCheckpointPlantedTempSymlink", grpc::StatusCode::OK, "",
       [](T&) {
         const std::string victim = T::A().dir + "/victim";
         const std::string planted = server::optimizer::CheckpointPath(CheckpointDir(), "opt") +
                                     ".tmp." + std::to_string(::getpid());
         { std::ofstream(victim) << "precious"; }
         if (::symlink(victim.c_str(), planted.c_str()) != 0) {
           return grpc::Status(grpc::StatusCode::UNKNOWN, "test setup failed");
         }
         v1::SaveCheckpointRequest req;
         req.set_group("opt");
         grpc::Status s = QTX_RPC(T::A(), optimizer, SaveCheckpoint, req);
         std::ifstream in(victim);
         const std::string content((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
         ::unlink(planted.c_str());
         ::unlink(victim.c_str());
         if (s.ok() && content != "precious") {
           return grpc::Status(grpc::StatusCode::DATA_LOSS,
                               "SaveCheckpoint followed the planted link: victim now holds " +
                                   std::to_string(content.size()) + " bytes");
         }
         return s;
       }},
      {"ReleaseUnknownGroup", kNotFound, "'nosuch' does not exist",
       [](T&) {
         v1::ReleaseGroupRequest req;
         req.set_group("nosuch");
         return QTX_RPC(T::A(), optimizer, ReleaseGroup, req);
       }},
  };
  return c;
}

TEST_P(BadInputTest, FailsCleanlyAndServerStaysUsable) {
  const Case& c = GetParam();
  const grpc::Status s = c.call(*this);
  EXPECT_EQ(s.error_code(), c.code)
      << c.name << ": got code " << s.error_code() << " (" << s.error_message() << ")";
  EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
  // Still healthy, still answering a valid call, nothing left pinned.
  EXPECT_EQ(HealthStatus(A()), 1);
  EXPECT_EQ(HealthStatus(B()), 1);
  v1::QuantizeRequest ok = ValidQuantize();
  EXPECT_TRUE(QTX_RPC(A(), quantizer, Quantize, ok).ok());
  EXPECT_EQ(SettledPins(), 0u);
  // No failed call applied, doubled or lost an optimizer step.
  v1::GetStateRequest get;
  get.set_group("opt");
  v1::GetStateResponse state;
  auto ctx = Ctx();
  ASSERT_TRUE(A().optimizer->GetState(ctx.get(), get, &state).ok());
  EXPECT_EQ(state.group().step(), 2);
  EXPECT_EQ(state.group().update_count(), 2);
}

INSTANTIATE_TEST_SUITE_P(Table, BadInputTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The table stays at least as large as the issue asks.
TEST(BadInputTable, HasAtLeastSixtyCases) { EXPECT_GE(Cases().size(), 60u); }

}  // namespace
}  // namespace qtx::robustness

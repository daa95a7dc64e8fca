// libFuzzer target over one qtx.v1 service (QTX_FUZZ_SERVICE: 1 Quantizer,
// 2 Memory, 3 Collective, 4 Optimizer), end to end: the first input byte picks
// the RPC, the rest is parsed as its request proto and sent through the
// generated stub to an in-process qtxd on the CPU device (validation,
// conversion, tensor resolution, the op, the response). Any crash, sanitizer
// report or hang (a call past its 20 s deadline) is a finding; error statuses
// are expected.
//
// QTX_FUZZ_WRITE_SEEDS=<dir>: write the seed corpus (valid requests) and exit.
#include <fcntl.h>
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "qtx/v1/collective.grpc.pb.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/optimizer.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "server/api/server.h"
#include "spdlog/spdlog.h"

#ifndef QTX_FUZZ_SERVICE
#error "define QTX_FUZZ_SERVICE"
#endif

namespace {

namespace v1 = ::qtx::v1;
constexpr uint64_t kRegionBytes = 64 * 1024;
const char kShmName[] = "/qtx-fuzz-region";
// Collective calls wait at most this long for a missing predecessor (a
// fuzzed sequence number far ahead), well within the 20 s call deadline.
constexpr uint32_t kGroupTimeoutMs = 2000;

struct Env {
  std::string dir;
  std::unique_ptr<qtx::server::api::QtxServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Quantizer::Stub> quantizer;
  std::unique_ptr<v1::Memory::Stub> memory;
  std::unique_ptr<v1::Collective::Stub> collective;
  std::unique_ptr<v1::Optimizer::Stub> optimizer;
};

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  return ctx;
}

// A call that outlives its deadline is a hang, and UNAVAILABLE means the
// server went away: report either as a finding. DEADLINE_EXCEEDED answered
// well before the call's own 20 s deadline is the server honouring a short
// timeout the request asked for (e.g. CreateGroup timeout_ms=1), not a hang.
void Check(
    const grpc::Status& s, const char* what,
    std::chrono::steady_clock::duration elapsed = std::chrono::steady_clock::duration::max()) {
  const bool hang =
      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && elapsed >= std::chrono::seconds(15);
  if (hang || s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::fprintf(stderr, "FINDING: %s: %d %s\n", what, s.error_code(), s.error_message().c_str());
    std::abort();
  }
}

v1::TensorRef F32(std::vector<int64_t> shape) {
  v1::TensorRef t;
  t.set_dtype(v1::FLOAT32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 17) - 8.0f;
  t.set_inline_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  return t;
}

v1::OffloadOptimizerStateRequest FixtureOffload() {
  v1::OffloadOptimizerStateRequest req;
  req.set_group("opt");
  v1::ParameterInit* p = req.add_parameters();
  p->set_name("w");
  p->add_shape(4);
  p->add_shape(8);
  *p->mutable_master() = F32({4, 8});
  return req;
}

Env& Get() {
  static Env* env = [] {
    spdlog::set_level(spdlog::level::off);
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in strings is logged per parse
    auto* e = new Env;
    char tmpl[] = "/tmp/qtx-fuzz-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) std::abort();
    e->dir = tmpl;
    const int fd = ::shm_open(kShmName, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ::ftruncate(fd, kRegionBytes) != 0) std::abort();
    ::close(fd);
    qtx::server::config::ServerConfig config;
    config.socket_path = e->dir + "/qtxd.sock";
    config.allow_client_shm = true;
    config.threads = 2;
    config.max_tensor_elements = int64_t{1} << 20;
    config.checkpoint_dir = e->dir + "/ckpt";
    config.optimizer_memory_limit_mb = 64;
    auto server = qtx::server::api::QtxServer::Create(config);
    if (!server.ok()) {
      std::fprintf(stderr, "qtxd: %s\n", server.status().ToString().c_str());
      std::abort();
    }
    e->server = std::move(*server);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    e->channel = grpc::CreateCustomChannel("unix:" + config.socket_path,
                                           grpc::InsecureChannelCredentials(), args);
    e->quantizer = v1::Quantizer::NewStub(e->channel);
    e->memory = v1::Memory::NewStub(e->channel);
    e->collective = v1::Collective::NewStub(e->channel);
    e->optimizer = v1::Optimizer::NewStub(e->channel);
    v1::RegisterRegionRequest reg;
    reg.set_name("r");
    reg.mutable_shm()->set_shm_name(kShmName);
    reg.mutable_shm()->set_byte_size(kRegionBytes);
    v1::RegisterRegionResponse rr;
    if (!e->memory->RegisterRegion(Ctx().get(), reg, &rr).ok()) std::abort();
    v1::CreateGroupRequest g;
    g.set_name("g");
    g.set_world_size(1);
    g.set_timeout_ms(kGroupTimeoutMs);
    v1::CreateGroupResponse gr;
    if (!e->collective->CreateGroup(Ctx().get(), g, &gr).ok()) std::abort();
    v1::OffloadOptimizerStateResponse orr;
    if (!e->optimizer->OffloadOptimizerState(Ctx().get(), FixtureOffload(), &orr).ok()) {
      std::abort();
    }
    std::atexit([] {
      ::shm_unlink(kShmName);
      std::system(("rm -rf '" + Get().dir + "'").c_str());
    });
    return e;
  }();
  return *env;
}

// Puts the server back to its fixture state every so often, so that state
// the fuzzer created (regions, groups) stays bounded.
void Tidy(Env& e) {
  static int calls = 0;
  if (++calls % 32 != 0) return;
#if QTX_FUZZ_SERVICE == 2
  v1::ListRegionsResponse list;
  if (e.memory->ListRegions(Ctx().get(), v1::ListRegionsRequest(), &list).ok()) {
    for (const auto& r : list.regions()) {
      if (r.name() == "r") continue;
      v1::UnregisterRegionRequest un;
      un.set_name(r.name());
      v1::UnregisterRegionResponse ur;
      Check(e.memory->UnregisterRegion(Ctx().get(), un, &ur), "tidy unregister");
    }
  }
#elif QTX_FUZZ_SERVICE == 3
  v1::ListGroupsResponse list;
  if (e.collective->ListGroups(Ctx().get(), v1::ListGroupsRequest(), &list).ok()) {
    for (const auto& g : list.groups()) {
      if (g.name() == "g" && g.state() == v1::READY) continue;
      v1::DestroyGroupRequest d;
      d.set_name(g.name());
      v1::DestroyGroupResponse dr;
      (void)e.collective->DestroyGroup(Ctx().get(), d, &dr);
    }
    bool have_g = false;
    for (const auto& g : list.groups()) have_g |= g.name() == "g" && g.state() == v1::READY;
    if (!have_g) {
      v1::CreateGroupRequest g;
      g.set_name("g");
      g.set_world_size(1);
      g.set_timeout_ms(kGroupTimeoutMs);
      v1::CreateGroupResponse gr;
      (void)e.collective->CreateGroup(Ctx().get(), g, &gr);
    }
  }
#elif QTX_FUZZ_SERVICE == 4
  v1::ListOptimizerGroupsResponse list;
  if (e.optimizer->ListGroups(Ctx().get(), v1::ListOptimizerGroupsRequest(), &list).ok()) {
    for (const auto& g : list.groups()) {
      v1::ReleaseGroupRequest rel;
      rel.set_group(g.name());
      v1::ReleaseGroupResponse rr;
      (void)e.optimizer->ReleaseGroup(Ctx().get(), rel, &rr);
    }
    v1::OffloadOptimizerStateResponse orr;
    (void)e.optimizer->OffloadOptimizerState(Ctx().get(), FixtureOffload(), &orr);
  }
#else
  (void)e;
#endif
}

template <typename Req>
bool Parse(const uint8_t* data, size_t size, Req* req) {
  return req->ParseFromArray(data, static_cast<int>(size));
}

#define QTX_FUZZ_CALL(stub, Method)                                 \
  do {                                                              \
    v1::Method##Request req;                                        \
    if (!Parse(data, size, &req)) return;                           \
    Adjust(&req);                                                   \
    v1::Method##Response resp;                                      \
    const auto start = std::chrono::steady_clock::now();            \
    const grpc::Status s = e.stub->Method(Ctx().get(), req, &resp); \
    Check(s, #Method, std::chrono::steady_clock::now() - start);    \
  } while (false)

template <typename Req>
void Adjust(Req*) {}
// Collective: one-rank groups only (a larger world would wait for peers that
// never come, or dial whatever address the input names), bounded timeouts.
[[maybe_unused]] void Adjust(v1::CreateGroupRequest* req) {
  req->set_world_size(1);
  req->set_rank(0);
  req->clear_coordinator();
  if (req->timeout_ms() == 0 || req->timeout_ms() > kGroupTimeoutMs) {
    req->set_timeout_ms(kGroupTimeoutMs);
  }
}

void RunOne(Env& e, uint8_t method, const uint8_t* data, size_t size) {
#if QTX_FUZZ_SERVICE == 1
  switch (method % 2) {
    case 0:
      QTX_FUZZ_CALL(quantizer, Quantize);
      break;
    case 1:
      QTX_FUZZ_CALL(quantizer, Dequantize);
      break;
  }
#elif QTX_FUZZ_SERVICE == 2
  switch (method % 3) {
    case 0:
      QTX_FUZZ_CALL(memory, RegisterRegion);
      break;
    case 1:
      QTX_FUZZ_CALL(memory, UnregisterRegion);
      break;
    case 2:
      QTX_FUZZ_CALL(memory, ListRegions);
      break;
  }
#elif QTX_FUZZ_SERVICE == 3
  switch (method % 5) {
    case 0:
      QTX_FUZZ_CALL(collective, CreateGroup);
      break;
    case 1:
      QTX_FUZZ_CALL(collective, AllGather);
      break;
    case 2:
      QTX_FUZZ_CALL(collective, DestroyGroup);
      break;
    case 3:
      QTX_FUZZ_CALL(collective, ListGroups);
      break;
    case 4:
      QTX_FUZZ_CALL(collective, AllGatherParameter);
      break;
  }
#elif QTX_FUZZ_SERVICE == 4
  switch (method % 7) {
    case 0:
      QTX_FUZZ_CALL(optimizer, OffloadOptimizerState);
      break;
    case 1:
      QTX_FUZZ_CALL(optimizer, Step);
      break;
    case 2:
      QTX_FUZZ_CALL(optimizer, GetState);
      break;
    case 3:
      QTX_FUZZ_CALL(optimizer, SaveCheckpoint);
      break;
    case 4:
      QTX_FUZZ_CALL(optimizer, LoadCheckpoint);
      break;
    case 5:
      QTX_FUZZ_CALL(optimizer, ReleaseGroup);
      break;
    case 6: {
      v1::ListOptimizerGroupsRequest req;
      v1::ListOptimizerGroupsResponse resp;
      Check(e.optimizer->ListGroups(Ctx().get(), req, &resp), "ListGroups");
      break;
    }
  }
#endif
}

// Valid requests, one per RPC: the seed corpus.
std::vector<std::string> Seeds() {
  std::vector<std::pair<uint8_t, std::string>> s;
#if QTX_FUZZ_SERVICE == 1
  for (int mode = 1; mode <= 2; ++mode) {
    v1::QuantizeRequest q;
    *q.mutable_input() = F32({3, 130});
    q.mutable_config()->set_scaling_mode(static_cast<v1::ScalingMode>(mode));
    q.mutable_config()->set_columnwise(true);
    s.emplace_back(0, q.SerializeAsString());
    v1::QuantizeRequest r;  // from the region, into the region
    v1::TensorRef* in = r.mutable_input();
    in->set_dtype(v1::BFLOAT16);
    in->add_shape(4);
    in->add_shape(128);
    in->mutable_region()->set_region("r");
    in->mutable_region()->set_size(4 * 128 * 2);
    r.mutable_config()->set_scaling_mode(static_cast<v1::ScalingMode>(mode));
    v1::RegionSlice* o = r.mutable_outputs()->mutable_rowwise_data();
    o->set_region("r");
    o->set_offset(8192);
    o->set_size(512);
    s.emplace_back(0, r.SerializeAsString());
  }
  {
    v1::QuantizeRequest q;
    *q.mutable_input() = F32({2, 128});
    q.mutable_config()->set_columnwise(true);
    v1::QuantizeResponse resp;
    if (Get().quantizer->Quantize(Ctx().get(), q, &resp).ok()) {
      v1::DequantizeRequest d;
      *d.mutable_input() = resp.result();
      s.emplace_back(1, d.SerializeAsString());
      d.set_output_dtype(v1::BFLOAT16);
      d.mutable_output()->set_region("r");
      d.mutable_output()->set_size(2 * 128 * 2);
      s.emplace_back(1, d.SerializeAsString());
    }
  }
#elif QTX_FUZZ_SERVICE == 2
  v1::RegisterRegionRequest reg;
  reg.set_name("x");
  reg.mutable_shm()->set_shm_name(kShmName);
  reg.mutable_shm()->set_offset(4096);
  reg.mutable_shm()->set_byte_size(4096);
  s.emplace_back(0, reg.SerializeAsString());
  v1::RegisterRegionRequest ipc;
  ipc.set_name("y");
  ipc.mutable_cuda_ipc()->set_ipc_handle(std::string(64, '\x01'));
  ipc.mutable_cuda_ipc()->set_byte_size(4096);
  s.emplace_back(0, ipc.SerializeAsString());
  v1::UnregisterRegionRequest un;
  un.set_name("x");
  s.emplace_back(1, un.SerializeAsString());
  s.emplace_back(2, std::string());
#elif QTX_FUZZ_SERVICE == 3
  v1::CreateGroupRequest g;
  g.set_name("h");
  g.set_world_size(1);
  g.set_backend(v1::GLOO);
  g.set_timeout_ms(2000);
  s.emplace_back(0, g.SerializeAsString());
  for (int mode = 1; mode <= 2; ++mode) {
    v1::AllGatherRequest a;
    a.set_group("g");
    *a.mutable_input() = F32({5, 130});
    a.set_mode(static_cast<v1::AllGatherMode>(mode));
    a.mutable_config()->set_columnwise(true);
    s.emplace_back(1, a.SerializeAsString());
  }
  v1::DestroyGroupRequest d;
  d.set_name("h");
  s.emplace_back(2, d.SerializeAsString());
  s.emplace_back(3, std::string());
  v1::AllGatherParameterRequest pg;  // the whole [5, 130] parameter on one rank
  pg.set_group("h");
  pg.mutable_shard()->add_shape(5);
  pg.mutable_shard()->add_shape(130);
  pg.mutable_shard()->mutable_config()->set_scaling_mode(v1::BLOCK_2D);
  pg.mutable_shard()->mutable_rowwise_data()->set_dtype(v1::UINT8);
  pg.mutable_shard()->mutable_rowwise_data()->add_shape(650);
  pg.mutable_shard()->mutable_rowwise_data()->set_inline_data(std::string(650, '\x38'));
  pg.mutable_shard()->mutable_rowwise_scale_inv()->set_dtype(v1::FLOAT32);
  pg.mutable_shard()->mutable_rowwise_scale_inv()->add_shape(1);
  pg.mutable_shard()->mutable_rowwise_scale_inv()->add_shape(4);
  pg.mutable_shard()->mutable_rowwise_scale_inv()->set_inline_data(std::string(16, '\0'));
  pg.mutable_range()->set_end(650);
  s.emplace_back(4, pg.SerializeAsString());
#elif QTX_FUZZ_SERVICE == 4
  v1::OffloadOptimizerStateRequest off = FixtureOffload();
  off.set_group("o2");
  off.set_moment_dtype(v1::MOMENT_DTYPE_BFLOAT16);
  off.mutable_hyper_params()->set_lr(0.01);
  s.emplace_back(0, off.SerializeAsString());
  v1::StepRequest st;
  st.set_group("opt");
  st.set_step(1);
  v1::Gradient* gr = st.add_gradients();
  gr->set_name("w");
  *gr->mutable_grad() = F32({4, 8});
  st.set_max_grad_norm(1.0);
  s.emplace_back(1, st.SerializeAsString());
  v1::ParameterDestination* dst = st.add_destinations();
  dst->set_name("w");
  dst->mutable_bf16()->set_region("r");
  dst->mutable_bf16()->set_size(64);
  st.mutable_gradients(0)->mutable_grad()->set_dtype(v1::FLOAT32);
  s.emplace_back(1, st.SerializeAsString());
  v1::GetStateRequest get;
  get.set_group("opt");
  get.set_include_moments(true);
  s.emplace_back(2, get.SerializeAsString());
  v1::SaveCheckpointRequest save;
  save.set_group("opt");
  s.emplace_back(3, save.SerializeAsString());
  v1::LoadCheckpointRequest load;
  load.set_group("opt");
  s.emplace_back(4, load.SerializeAsString());
  v1::ReleaseGroupRequest rel;
  rel.set_group("o2");
  s.emplace_back(5, rel.SerializeAsString());
  s.emplace_back(6, std::string());
#endif
  std::vector<std::string> out;
  for (auto& [m, bytes] : s) out.push_back(std::string(1, static_cast<char>(m)) + bytes);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Env& e = Get();
  if (const char* dir = std::getenv("QTX_FUZZ_WRITE_SEEDS")) {
    const std::vector<std::string> seeds = Seeds();
    for (size_t i = 0; i < seeds.size(); ++i) {
      const std::string path = std::string(dir) + "/seed-" + std::to_string(i);
      std::FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr) std::abort();
      std::fwrite(seeds[i].data(), 1, seeds[i].size(), f);
      std::fclose(f);
    }
    std::fprintf(stderr, "wrote %zu seeds to %s\n", seeds.size(), dir);
    std::exit(0);
  }
  (void)e;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Env& e = Get();
  RunOne(e, data[0], data + 1, size - 1);
  Tidy(e);
  return 0;
}

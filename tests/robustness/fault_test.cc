// Process-level faults against real qtxd processes:
//   - a client process killed mid-call (the qtx CLI, SIGKILL);
//   - qtxd SIGKILLed during Step and during SaveCheckpoint, then restarted:
//     the state is the last checkpoint, bit-identical to an uninterrupted
//     sidecar at that step, step numbers continue from it, never doubled;
//   - the checkpoint directory unwritable (replaced by a file; read-only when
//     not root) and full (RLIMIT_FSIZE): a clear error, the state intact, the
//     previous checkpoint still loadable, and saving works once fixed.
//   - a client truncating a registered shm object while calls read and write
//     it (Quantize, Step, GetState): each call fails alone, qtxd lives on.
// (A peer sidecar killed during AllGather: tests/server/collective,
// CollectiveFaults.MissingRankMismatchedNAndKilledSidecar.)
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/optimizer.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/unique_shm.h"

namespace qtx::robustness {
namespace {

namespace v1 = ::qtx::v1;
namespace fs = std::filesystem;
using ::qtx::testing::QtxdProcess;
using ::qtx::testing::Subprocess;
using ::testing::AnyOf;
using ::testing::HasSubstr;

std::chrono::system_clock::time_point In(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

// Child processes not quiet with QTX_FAULT_TEST_VERBOSE set.
bool Quiet() { return std::getenv("QTX_FAULT_TEST_VERBOSE") == nullptr; }

// A qtxd (QtxdProcess) with its checkpoints in `dir`/ckpt, and stubs to it.
class Sidecar {
 public:
  // `fsize_limit` > 0: RLIMIT_FSIZE of qtxd (a write past it fails with EFBIG).
  Sidecar(const std::string& dir, std::vector<std::string> extra, rlim_t fsize_limit = 0) {
    std::vector<std::string> args = {"--device=cpu", "--checkpoint_dir=" + dir + "/ckpt",
                                     "--threads=2", "--shutdown_grace_s=1"};
    args.insert(args.end(), extra.begin(), extra.end());
    QtxdProcess::Options options;
    options.process.quiet = Quiet();
    options.process.file_size_limit = fsize_limit;
    absl::StatusOr<std::unique_ptr<QtxdProcess>> process =
        QtxdProcess::Start(QTXD_PATH, args, options);
    if (!process.ok()) {
      start_status_ = process.status();
      return;
    }
    process_ = *std::move(process);
    grpc::ChannelArguments channel_args;
    channel_args.SetMaxReceiveMessageSize(-1);
    channel_args.SetMaxSendMessageSize(-1);
    // A fresh channel per sidecar (no reuse of a dead one's subchannel).
    channel_args.SetInt("qtx.fault_test.instance", ++instances_);
    channel_ = grpc::CreateCustomChannel("unix:" + process_->socket_path(),
                                         grpc::InsecureChannelCredentials(), channel_args);
    quantizer = v1::Quantizer::NewStub(channel_);
    optimizer = v1::Optimizer::NewStub(channel_);
    memory = v1::Memory::NewStub(channel_);
  }

  // kill -9, as a crash would (no shutdown checkpoint).
  ~Sidecar() {
    if (process_ != nullptr) process_->Kill();
  }

  // Whether qtxd started and serves (QtxdProcess::Start waited for it).
  ::testing::AssertionResult Started() const {
    if (process_ != nullptr) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "qtxd did not start: " << start_status_;
  }

  // REQUIRES: Started().
  QtxdProcess& process() { return *process_; }
  const std::string& socket() const { return process_->socket_path(); }

  std::unique_ptr<v1::Quantizer::Stub> quantizer;
  std::unique_ptr<v1::Optimizer::Stub> optimizer;
  std::unique_ptr<v1::Memory::Stub> memory;

 private:
  static inline int instances_ = 0;
  absl::Status start_status_;
  std::unique_ptr<QtxdProcess> process_;
  std::shared_ptr<grpc::Channel> channel_;
};

std::string TempDir() {
  char tmpl[] = "/tmp/qtx-fault-XXXXXX";
  const char* d = ::mkdtemp(tmpl);
  return d == nullptr ? "" : d;
}

v1::TensorRef F32(int64_t m, int64_t n, float (*f)(int64_t)) {
  v1::TensorRef t;
  t.set_dtype(v1::FLOAT32);
  t.add_shape(m);
  t.add_shape(n);
  std::vector<float> v(m * n);
  for (int64_t i = 0; i < m * n; ++i) v[i] = f(i);
  t.set_inline_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  return t;
}

float Init(int64_t i) { return static_cast<float>((i * 7919) % 1000) / 1000.0f - 0.5f; }
float Grad(int64_t i) { return static_cast<float>((i * 104729) % 200) / 1000.0f - 0.1f; }

constexpr int64_t kM = 512, kN = 1024;  // 2 MiB of master weights, 6 MiB of state

grpc::Status Offload(Sidecar& s, const std::string& group, int64_t m = kM, int64_t n = kN) {
  v1::OffloadOptimizerStateRequest req;
  req.set_group(group);
  v1::ParameterInit* p = req.add_parameters();
  p->set_name("w");
  p->add_shape(m);
  p->add_shape(n);
  *p->mutable_master() = F32(m, n, Init);
  v1::OffloadOptimizerStateResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60000));
  return s.optimizer->OffloadOptimizerState(&ctx, req, &resp);
}

grpc::Status Step(Sidecar& s, const std::string& group, int64_t step,
                  v1::StepResponse* out = nullptr, int64_t m = kM, int64_t n = kN) {
  v1::StepRequest req;
  req.set_group(group);
  req.set_step(step);
  req.set_omit_parameters(true);
  v1::Gradient* g = req.add_gradients();
  g->set_name("w");
  *g->mutable_grad() = F32(m, n, Grad);
  v1::StepResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60000));
  grpc::Status st = s.optimizer->Step(&ctx, req, out != nullptr ? out : &resp);
  return st;
}

grpc::Status GetState(Sidecar& s, const std::string& group, v1::GetStateResponse* resp) {
  v1::GetStateRequest req;
  req.set_group(group);
  req.set_include_moments(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60000));
  return s.optimizer->GetState(&ctx, req, resp);
}

grpc::Status Save(Sidecar& s, const std::string& group) {
  v1::SaveCheckpointRequest req;
  req.set_group(group);
  v1::SaveCheckpointResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60000));
  return s.optimizer->SaveCheckpoint(&ctx, req, &resp);
}

// Master weights and moments of `group` on `s`, as one string.
std::string StateBytes(Sidecar& s, const std::string& group, int64_t* step, int64_t* updates) {
  v1::GetStateResponse resp;
  grpc::Status st = GetState(s, group, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  *step = resp.group().step();
  *updates = resp.group().update_count();
  std::string out;
  for (const auto& p : resp.parameters()) {
    out += p.master().inline_data();
    out += p.exp_avg().inline_data();
    out += p.exp_avg_sq().inline_data();
  }
  return out;
}

// The state an uninterrupted sidecar reaches after `steps` steps.
std::string ReferenceState(int64_t steps) {
  const std::string dir = TempDir();
  Sidecar ref(dir, {});
  if (!ref.Started()) {
    ADD_FAILURE() << ref.Started().message();
    return "";
  }
  EXPECT_TRUE(Offload(ref, "opt").ok());
  for (int64_t i = 1; i <= steps; ++i) EXPECT_TRUE(Step(ref, "opt", i).ok());
  int64_t step = 0, updates = 0;
  std::string bytes = StateBytes(ref, "opt", &step, &updates);
  EXPECT_EQ(step, steps);
  ref.process().Kill();
  fs::remove_all(dir);
  return bytes;
}

TEST(Faults, ClientProcessKilledMidCall) {
  const std::string dir = TempDir();
  Sidecar s(dir, {});
  ASSERT_TRUE(s.Started());
  for (int i = 0; i < 5; ++i) {
    // A large inline Quantize from the CLI, killed while it is in flight.
    Subprocess::Options quiet;
    quiet.quiet = Quiet();
    absl::StatusOr<std::unique_ptr<Subprocess>> cli =
        Subprocess::Start({QTX_CLI_PATH, "--target=unix:" + s.socket(), "quantize",
                           "--shape=2048x4096", "--usages=rowwise,columnwise"},
                          quiet);
    ASSERT_TRUE(cli.ok()) << cli.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + 40 * i));
    (*cli)->Kill();
  }
  // Still serving, correct size.
  v1::QuantizeRequest req;
  *req.mutable_input() = F32(256, 256, Init);
  v1::QuantizeResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30000));
  grpc::Status st = s.quantizer->Quantize(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.result().rowwise_data().inline_data().size(), 256u * 256u);
  EXPECT_TRUE(s.process().alive());
  fs::remove_all(dir);
}

TEST(Faults, QtxdKilledDuringStepRestartsFromLastCheckpoint) {
  const std::string dir = TempDir();
  {
    Sidecar s(dir, {"--checkpoint_every_steps=3"});
    ASSERT_TRUE(s.Started());
    ASSERT_TRUE(Offload(s, "opt").ok());
    for (int64_t i = 1; i <= 4; ++i) ASSERT_TRUE(Step(s, "opt", i).ok());
    // Step 5 in flight; SIGKILL.
    std::thread step5([&] { (void)Step(s, "opt", 5); });
    std::this_thread::sleep_for(std::chrono::milliseconds(15));
    s.process().Kill();
    step5.join();
  }
  Sidecar s(dir, {"--checkpoint_every_steps=3"});
  ASSERT_TRUE(s.Started());
  int64_t step = 0, updates = 0;
  const std::string restored = StateBytes(s, "opt", &step, &updates);
  // Step 3 was the last checkpoint: steps 4 and 5 are lost, never half-applied.
  EXPECT_EQ(step, 3);
  EXPECT_EQ(updates, 3);
  EXPECT_TRUE(restored == ReferenceState(3)) << "restored state differs from 3 clean steps";
  // Step numbers continue from the checkpoint: 4 is next, 6 is refused.
  grpc::Status st = Step(s, "opt", 6);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("is at step 3"));
  v1::StepResponse r4;
  ASSERT_TRUE(Step(s, "opt", 4, &r4).ok());
  EXPECT_FALSE(r4.stats().replayed());
  v1::StepResponse again;
  ASSERT_TRUE(Step(s, "opt", 4, &again).ok());  // a retry is answered, not applied
  EXPECT_TRUE(again.stats().replayed());
  const std::string after = StateBytes(s, "opt", &step, &updates);
  EXPECT_EQ(step, 4);
  EXPECT_EQ(updates, 4);
  EXPECT_TRUE(after == ReferenceState(4)) << "state after the retried step 4 differs";
  s.process().Kill();
  fs::remove_all(dir);
}

TEST(Faults, QtxdKilledDuringSaveCheckpointKeepsAValidOne) {
  const std::string dir = TempDir();
  for (int attempt = 0; attempt < 3; ++attempt) {
    int64_t saved = 0;
    {
      Sidecar s(dir, {});
      ASSERT_TRUE(s.Started());
      if (attempt == 0) {
        ASSERT_TRUE(Offload(s, "opt").ok());
      }
      v1::GetStateResponse state;
      ASSERT_TRUE(GetState(s, "opt", &state).ok());
      saved = state.group().step();
      ASSERT_TRUE(Step(s, "opt", saved + 1).ok());
      ASSERT_TRUE(Save(s, "opt").ok());  // checkpoint at saved + 1
      ASSERT_TRUE(Step(s, "opt", saved + 2).ok());
      std::thread save([&] { (void)Save(s, "opt"); });  // checkpoint at saved + 2, killed
      std::this_thread::sleep_for(std::chrono::milliseconds(2 + 3 * attempt));
      s.process().Kill();
      save.join();
    }
    Sidecar s(dir, {});
    ASSERT_TRUE(s.Started());
    v1::GetStateResponse state;
    grpc::Status st = GetState(s, "opt", &state);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(state.group().error(), "");
    EXPECT_THAT(state.group().step(), AnyOf(saved + 1, saved + 2));
    EXPECT_EQ(state.group().update_count(), state.group().step());
    ASSERT_TRUE(Save(s, "opt").ok());
    s.process().Kill();
  }
  fs::remove_all(dir);
}

TEST(Faults, CheckpointDirectoryUnwritable) {
  const std::string dir = TempDir();
  Sidecar s(dir, {});
  ASSERT_TRUE(s.Started());
  ASSERT_TRUE(Offload(s, "opt").ok());
  ASSERT_TRUE(Step(s, "opt", 1).ok());
  ASSERT_TRUE(Save(s, "opt").ok());
  // The directory is replaced by a plain file: nothing can be written there.
  const std::string ckpt = dir + "/ckpt";
  fs::rename(ckpt, dir + "/ckpt.saved");
  {
    std::FILE* f = std::fopen(ckpt.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  ASSERT_TRUE(Step(s, "opt", 2).ok());
  grpc::Status st = Save(s, "opt");
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(st.error_code(),
              AnyOf(grpc::StatusCode::INTERNAL, grpc::StatusCode::FAILED_PRECONDITION,
                    grpc::StatusCode::PERMISSION_DENIED));
  EXPECT_THAT(st.error_message(), HasSubstr(ckpt));
  // The in-memory state is intact and steps go on.
  ASSERT_TRUE(Step(s, "opt", 3).ok());
  int64_t step = 0, updates = 0;
  (void)StateBytes(s, "opt", &step, &updates);
  EXPECT_EQ(step, 3);
  if (::geteuid() != 0) {
    // A read-only directory (root ignores the mode bits).
    fs::remove(ckpt);
    fs::rename(dir + "/ckpt.saved", ckpt);
    ::chmod(ckpt.c_str(), 0500);
    st = Save(s, "opt");
    EXPECT_FALSE(st.ok());
    EXPECT_THAT(st.error_message(), HasSubstr(ckpt));
    ::chmod(ckpt.c_str(), 0700);
  } else {
    fs::remove(ckpt);
    fs::rename(dir + "/ckpt.saved", ckpt);
  }
  // Fixed: saving works again, and the checkpoint holds step 3.
  ASSERT_TRUE(Save(s, "opt").ok());
  v1::LoadCheckpointRequest load;
  load.set_group("opt");
  v1::LoadCheckpointResponse loaded;
  grpc::ClientContext ctx;
  ASSERT_TRUE(s.optimizer->LoadCheckpoint(&ctx, load, &loaded).ok());
  EXPECT_EQ(loaded.group().step(), 3);
  s.process().Kill();
  fs::remove_all(dir);
}

TEST(Faults, CheckpointDiskFull) {
  const std::string dir = TempDir();
  // Files written by qtxd may not exceed 1 MiB (a "full" disk for the 6 MiB
  // group, room for the small one).
  Sidecar s(dir, {}, /*fsize_limit=*/1 << 20);
  ASSERT_TRUE(s.Started());
  ASSERT_TRUE(Offload(s, "small", 64, 64).ok());
  ASSERT_TRUE(Offload(s, "big").ok());
  ASSERT_TRUE(Step(s, "big", 1).ok());
  grpc::Status st = Save(s, "big");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("big"));
  // No partial checkpoint file is left to be mistaken for a good one.
  for (const auto& e : fs::directory_iterator(dir + "/ckpt")) {
    EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr("big")))
        << "left behind: " << e.path();
  }
  // The small group still checkpoints; the big one keeps stepping.
  ASSERT_TRUE(Save(s, "small").ok());
  ASSERT_TRUE(Step(s, "big", 2).ok());
  int64_t step = 0, updates = 0;
  (void)StateBytes(s, "big", &step, &updates);
  EXPECT_EQ(step, 2);
  // SIGTERM: the shutdown checkpoint of "big" fails too, but qtxd still exits
  // (and says so); the small group's checkpoint survives a restart.
  absl::StatusOr<int> exit_status = s.process().Stop();
  ASSERT_TRUE(exit_status.ok()) << exit_status.status();
  EXPECT_LT(*exit_status, 128) << "killed by signal " << *exit_status - 128;
  Sidecar again(dir, {});
  ASSERT_TRUE(again.Started());
  v1::GetStateResponse small;
  ASSERT_TRUE(GetState(again, "small", &small).ok());
  EXPECT_EQ(small.group().error(), "");
  again.process().Kill();
  fs::remove_all(dir);
}

// A client's POSIX shm object, filled with floats, that the test can shrink
// while qtxd uses it.
class ClientShm {
 public:
  explicit ClientShm(size_t bytes) : bytes_(bytes) {
    fd_ = ::qtx::testing::CreateUniqueShm("qtx-fault", &name_);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) return;
    auto* f = static_cast<float*>(p);
    for (size_t i = 0; i < bytes / 4; ++i) f[i] = Init(static_cast<int64_t>(i));
    ::munmap(p, bytes);
    ok_ = true;
  }
  ~ClientShm() {
    if (fd_ >= 0) ::close(fd_);
    ::shm_unlink(name_.c_str());
  }
  bool ok() const { return ok_; }
  void Shrink() { (void)::ftruncate(fd_, 0); }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  size_t bytes_;
  int fd_ = -1;
  bool ok_ = false;
};

grpc::Status Register(Sidecar& s, const std::string& region, const ClientShm& shm, size_t bytes) {
  v1::RegisterRegionRequest req;
  req.set_name(region);
  req.mutable_shm()->set_shm_name(shm.name());
  req.mutable_shm()->set_byte_size(bytes);
  v1::RegisterRegionResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30000));
  return s.memory->RegisterRegion(&ctx, req, &resp);
}

v1::RegionSlice Slice(const std::string& region, uint64_t offset, uint64_t size) {
  v1::RegionSlice r;
  r.set_region(region);
  r.set_offset(offset);
  r.set_size(size);
  return r;
}

// A client shrinks its registered shm object to nothing while qtxd reads
// (Quantize input, Step gradients) or writes (Quantize outputs, GetState
// destinations) it. Before the SIGBUS guard, qtxd died on 5 of 5 tries. Now
// each such call fails alone with DATA_LOSS (or, if the shrink came before
// the call pinned the region, FAILED_PRECONDITION; or it finished first: OK),
// and qtxd keeps serving. The shrink is timed at a fraction of the call's
// measured duration so that most tries land mid-call.
TEST(Faults, ShmShrunkDuringCallsFailsThoseCallsOnly) {
  const std::string dir = TempDir();
  Sidecar s(dir, {"--allow_client_shm"});
  ASSERT_TRUE(s.Started());
  constexpr int64_t kRows = 2048, kCols = 4096;  // 32 MiB of FLOAT32
  constexpr uint64_t kF32 = kRows * kCols * 4;
  constexpr uint64_t kFp8 = kRows * kCols;
  ASSERT_TRUE(Offload(s, "opt", kRows, kCols).ok());

  struct Kind {
    const char* name;
    uint64_t bytes;  // of the shm object
    std::function<grpc::Status(const std::string& region, int64_t attempt)> call;
  };
  int64_t step = 0;
  const std::vector<Kind> kinds = {
      {"Quantize", kF32 + kFp8,
       [&](const std::string& region, int64_t) {
         v1::QuantizeRequest req;
         req.mutable_input()->set_dtype(v1::FLOAT32);
         req.mutable_input()->add_shape(kRows);
         req.mutable_input()->add_shape(kCols);
         *req.mutable_input()->mutable_region() = Slice(region, 0, kF32);
         *req.mutable_outputs()->mutable_rowwise_data() = Slice(region, kF32, kFp8);
         v1::QuantizeResponse resp;
         grpc::ClientContext ctx;
         ctx.set_deadline(In(60000));
         return s.quantizer->Quantize(&ctx, req, &resp);
       }},
      {"Step", kF32,
       [&](const std::string& region, int64_t) {
         v1::StepRequest req;
         req.set_group("opt");
         req.set_step(++step);
         req.set_omit_parameters(true);
         v1::Gradient* g = req.add_gradients();
         g->set_name("w");
         g->mutable_grad()->set_dtype(v1::FLOAT32);
         g->mutable_grad()->add_shape(kRows);
         g->mutable_grad()->add_shape(kCols);
         *g->mutable_grad()->mutable_region() = Slice(region, 0, kF32);
         v1::StepResponse resp;
         grpc::ClientContext ctx;
         ctx.set_deadline(In(60000));
         grpc::Status st = s.optimizer->Step(&ctx, req, &resp);
         if (st.error_code() == grpc::StatusCode::FAILED_PRECONDITION) --step;  // not applied
         return st;
       }},
      {"GetState", 3 * kF32,
       [&](const std::string& region, int64_t) {
         v1::GetStateRequest req;
         req.set_group("opt");
         req.set_include_moments(true);
         v1::StateDestination* d = req.add_destinations();
         d->set_name("w");
         *d->mutable_master() = Slice(region, 0, kF32);
         *d->mutable_exp_avg() = Slice(region, kF32, kF32);
         *d->mutable_exp_avg_sq() = Slice(region, 2 * kF32, kF32);
         v1::GetStateResponse resp;
         grpc::ClientContext ctx;
         ctx.set_deadline(In(60000));
         return s.optimizer->GetState(&ctx, req, &resp);
       }},
  };
  int region_id = 0;
  for (const Kind& kind : kinds) {
    // The call's duration on an intact region.
    ClientShm intact(kind.bytes);
    ASSERT_TRUE(intact.ok());
    const std::string r0 = "fault-" + std::to_string(region_id++);
    ASSERT_TRUE(Register(s, r0, intact, kind.bytes).ok());
    const auto t0 = std::chrono::steady_clock::now();
    grpc::Status first = kind.call(r0, 0);
    ASSERT_TRUE(first.ok()) << kind.name << ": " << first.error_message();
    const auto duration = std::chrono::steady_clock::now() - t0;

    int data_loss = 0;
    for (int attempt = 0; attempt < 5; ++attempt) {
      ClientShm shm(kind.bytes);
      ASSERT_TRUE(shm.ok());
      const std::string r = "fault-" + std::to_string(region_id++);
      ASSERT_TRUE(Register(s, r, shm, kind.bytes).ok());
      grpc::Status st;
      std::thread caller([&] { st = kind.call(r, attempt); });
      std::this_thread::sleep_for(duration * (2 + attempt) / 10);
      shm.Shrink();
      caller.join();
      ASSERT_TRUE(s.process().alive()) << kind.name << " try " << attempt << " killed qtxd";
      EXPECT_THAT(st.error_code(), AnyOf(grpc::StatusCode::OK, grpc::StatusCode::DATA_LOSS,
                                         grpc::StatusCode::FAILED_PRECONDITION))
          << kind.name << ": " << st.error_message();
      if (st.error_code() == grpc::StatusCode::DATA_LOSS) {
        ++data_loss;
        EXPECT_THAT(st.error_message(), HasSubstr("was truncated while this request used it"));
      }
      // The damaged region refuses later calls until registered again.
      grpc::Status again = kind.call(r, attempt);
      EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
          << kind.name << ": " << again.error_message();
    }
    EXPECT_GT(data_loss, 0) << kind.name << ": no shrink landed mid-call in 5 tries";
    // Other regions and clients are unaffected.
    grpc::Status after = kind.call(r0, 9);
    EXPECT_TRUE(after.ok()) << kind.name << ": " << after.error_message();
  }
  EXPECT_TRUE(s.process().alive());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace qtx::robustness

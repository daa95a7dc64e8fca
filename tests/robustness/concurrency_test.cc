// Concurrency and in-process faults against an in-process qtxd (the TSan and
// ASan jobs run this): mixed concurrent calls from many threads, a region
// unregistered while calls use it, calls cancelled or timed out mid-flight.
// Every call must end OK or with its expected error; the server must stay
// usable and leave nothing pinned.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/optimizer.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "server/api/server.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::robustness {
namespace {

using ::qtx::testing::ShmObject;
namespace v1 = ::qtx::v1;

// Under TSan/ASan everything runs several times slower: scale the work down.
int Iterations(int n) {
  const char* s = std::getenv("QTX_STRESS_SCALE");
  const double scale = s == nullptr ? 1.0 : std::atof(s);
  return std::max(1, static_cast<int>(n * scale));
}

std::chrono::system_clock::time_point In(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

v1::TensorRef F32(int64_t m, int64_t n, float value) {
  v1::TensorRef t;
  t.set_dtype(v1::FLOAT32);
  t.add_shape(m);
  t.add_shape(n);
  std::vector<float> v(m * n, value);
  t.set_inline_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  return t;
}

class ConcurrencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtx-conc-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    server::config::ServerConfig config;
    config.socket_path = dir_ + "/qtxd.sock";
    config.allow_client_shm = true;
    config.threads = 4;
    config.checkpoint_dir = dir_ + "/ckpt";
    QTX_ASSERT_OK_AND_ASSIGN(server_, server::api::QtxServer::Create(config));
    channel_ =
        grpc::CreateChannel("unix:" + config.socket_path, grpc::InsecureChannelCredentials());
    quantizer_ = v1::Quantizer::NewStub(channel_);
    memory_ = v1::Memory::NewStub(channel_);
    optimizer_ = v1::Optimizer::NewStub(channel_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(5));
    server_.reset();
    std::system(("rm -rf '" + dir_ + "'").c_str());
  }

  grpc::Status Register(const std::string& name, const ShmObject& shm) {
    v1::RegisterRegionRequest req;
    req.set_name(name);
    req.mutable_shm()->set_shm_name(shm.name());
    req.mutable_shm()->set_byte_size(shm.size());
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30000));
    return memory_->RegisterRegion(&ctx, req, &resp);
  }
  grpc::Status Unregister(const std::string& name) {
    v1::UnregisterRegionRequest req;
    req.set_name(name);
    v1::UnregisterRegionResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30000));
    return memory_->UnregisterRegion(&ctx, req, &resp);
  }
  grpc::Status QuantizeRegion(const std::string& region, int64_t m, int64_t n) {
    v1::QuantizeRequest req;
    v1::TensorRef* in = req.mutable_input();
    in->set_dtype(v1::FLOAT32);
    in->add_shape(m);
    in->add_shape(n);
    in->mutable_region()->set_region(region);
    in->mutable_region()->set_size(m * n * 4);
    req.mutable_config()->set_columnwise(true);
    v1::QuantizeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60000));
    return quantizer_->Quantize(&ctx, req, &resp);
  }
  grpc::Status QuantizeInline(int64_t m, int64_t n, int deadline_ms = 60000,
                              bool cancel_soon = false) {
    v1::QuantizeRequest req;
    *req.mutable_input() = F32(m, n, 1.5f);
    req.mutable_config()->set_columnwise(true);
    v1::QuantizeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(deadline_ms));
    std::thread canceller;
    if (cancel_soon) {
      canceller = std::thread([&ctx] {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        ctx.TryCancel();
      });
    }
    grpc::Status s = quantizer_->Quantize(&ctx, req, &resp);
    if (canceller.joinable()) canceller.join();
    if (s.ok()) {
      // The answer is right: 1.5 everywhere quantizes to one code per element.
      EXPECT_EQ(resp.result().rowwise_data().inline_data().size(), static_cast<size_t>(m * n));
    }
    return s;
  }
  uint32_t SettledPins() {
    uint32_t in_use = 0;
    for (int i = 0; i < 500; ++i) {
      v1::ListRegionsResponse resp;
      grpc::ClientContext ctx;
      if (!memory_->ListRegions(&ctx, v1::ListRegionsRequest(), &resp).ok()) return 999;
      in_use = 0;
      for (const auto& r : resp.regions()) in_use += r.in_use();
      if (in_use == 0) return 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return in_use;
  }

  std::string dir_;
  std::unique_ptr<server::api::QtxServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Quantizer::Stub> quantizer_;
  std::unique_ptr<v1::Memory::Stub> memory_;
  std::unique_ptr<v1::Optimizer::Stub> optimizer_;
};

TEST_F(ConcurrencyTest, MixedCallsFromManyThreads) {
  ShmObject shm(256 * 256 * 4);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(Register("shared", shm).ok());
  // An optimizer group that one thread steps while others read it.
  {
    v1::OffloadOptimizerStateRequest req;
    req.set_group("g");
    v1::ParameterInit* p = req.add_parameters();
    p->set_name("w");
    p->add_shape(64);
    p->add_shape(64);
    *p->mutable_master() = F32(64, 64, 0.5f);
    v1::OffloadOptimizerStateResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(optimizer_->OffloadOptimizerState(&ctx, req, &resp).ok());
  }
  const int iters = Iterations(40);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < iters; ++i) {
        grpc::Status s;
        switch ((t + i) % 4) {
          case 0:
            s = QuantizeInline(96, 384);
            break;
          case 1:
            s = QuantizeRegion("shared", 256, 256);
            break;
          case 2: {
            v1::ListRegionsResponse resp;
            grpc::ClientContext ctx;
            s = memory_->ListRegions(&ctx, v1::ListRegionsRequest(), &resp);
            break;
          }
          case 3: {
            v1::GetStateRequest req;
            req.set_group("g");
            req.set_include_moments(true);
            v1::GetStateResponse resp;
            grpc::ClientContext ctx;
            s = optimizer_->GetState(&ctx, req, &resp);
            if (s.ok() && resp.parameters_size() != 1) s = grpc::Status(grpc::INTERNAL, "shape");
            break;
          }
        }
        if (!s.ok()) {
          ++failures;
          ADD_FAILURE() << "thread " << t << " call " << i << ": " << s.error_message();
        }
      }
    });
  }
  // Meanwhile: steps 1..N, each retried once (a retry is answered, not applied).
  const int steps = Iterations(20);
  for (int step = 1; step <= steps; ++step) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      v1::StepRequest req;
      req.set_group("g");
      req.set_step(step);
      v1::Gradient* g = req.add_gradients();
      g->set_name("w");
      *g->mutable_grad() = F32(64, 64, 0.01f);
      v1::StepResponse resp;
      grpc::ClientContext ctx;
      grpc::Status s = optimizer_->Step(&ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.stats().replayed(), attempt == 1);
    }
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  v1::GetStateRequest req;
  req.set_group("g");
  v1::GetStateResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(optimizer_->GetState(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.group().step(), steps);
  EXPECT_EQ(resp.group().update_count(), steps);
  EXPECT_EQ(SettledPins(), 0u);
}

// A region unregistered while calls use it: Unregister waits for the calls
// that pinned it; later calls get NOT_FOUND; nothing reads unmapped memory
// (ASan) or races (TSan).
TEST_F(ConcurrencyTest, RegionUnregisteredWhileInUse) {
  ShmObject shm(512 * 512 * 4);
  ASSERT_TRUE(shm.ok());
  std::memset(shm.data(), 0, shm.size());
  const int rounds = Iterations(8);
  for (int round = 0; round < rounds; ++round) {
    ASSERT_TRUE(Register("hot", shm).ok());
    std::atomic<bool> stop{false};
    std::atomic<int> ok{0}, not_found{0}, other{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        while (!stop.load()) {
          grpc::Status s = QuantizeRegion("hot", 512, 512);
          if (s.ok()) {
            ++ok;
          } else if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
            ++not_found;
            return;  // unregistered: this thread is done
          } else {
            ++other;
            ADD_FAILURE() << s.error_code() << " " << s.error_message();
            return;
          }
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 10 * round));
    grpc::Status s = Unregister("hot");
    EXPECT_TRUE(s.ok()) << s.error_message();
    // After Unregister returned, the region is gone for every new call.
    EXPECT_EQ(QuantizeRegion("hot", 512, 512).error_code(), grpc::StatusCode::NOT_FOUND);
    stop = true;
    for (auto& th : threads) th.join();
    EXPECT_EQ(other.load(), 0);
    EXPECT_EQ(SettledPins(), 0u);
  }
}

// Client gives up mid-call (deadline or cancel): the server drops the work
// and keeps serving; nothing stays pinned.
TEST_F(ConcurrencyTest, CancelledAndTimedOutCalls) {
  ShmObject shm(1024 * 1024 * 4);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(Register("big", shm).ok());
  const int iters = Iterations(30);
  std::vector<std::thread> threads;
  std::atomic<int> unexpected{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < iters; ++i) {
        grpc::Status s;
        if (t % 2 == 0) {
          s = QuantizeInline(512, 1024, /*deadline_ms=*/1 + i % 5);
        } else {
          s = QuantizeInline(512, 1024, 60000, /*cancel_soon=*/true);
        }
        const auto code = s.error_code();
        if (code != grpc::StatusCode::OK && code != grpc::StatusCode::DEADLINE_EXCEEDED &&
            code != grpc::StatusCode::CANCELLED) {
          ++unexpected;
          ADD_FAILURE() << code << " " << s.error_message();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(unexpected.load(), 0);
  // Still serving, correct answers, no pins.
  EXPECT_TRUE(QuantizeInline(128, 256).ok());
  EXPECT_TRUE(QuantizeRegion("big", 1024, 1024).ok());
  EXPECT_EQ(SettledPins(), 0u);
  EXPECT_TRUE(Unregister("big").ok());
}

}  // namespace
}  // namespace qtx::robustness

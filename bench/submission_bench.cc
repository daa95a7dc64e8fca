// How should a stream-ordered call reach qtxd? Issue 12 asks to measure the
// two cheap transports for a descriptor and keep the faster:
//   channel_stream  one long-lived bidirectional gRPC stream per channel
//                   (qtx::Channel::Quantize: "ready = n", one stream write)
//   async_unary     one asynchronous unary call per op (the callback API:
//                   a ClientContext, StartCall, return; the reply arrives on
//                   gRPC's thread)
// Both send the same descriptor (a QuantizeRequest whose tensors are region
// slices) to the same qtxd, and the measure is what the trainer pays: host
// time from the call to its return, p50 and p99. A plain synchronous unary
// Quantize is the reference. qtxd runs on the CPU device here (its work,
// [rows, 128] BF16, is small and runs after the caller's measured part), so
// this runs on any machine; the GPU path adds only the stream memory
// operations, the same for both transports. JSON lines on stdout.
//
//   submission_bench --qtxd=build/server/qtxd [--ops=20000] [--rounds=5] [--rows=128]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench_util.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "tests/testing/qtxd_process.h"

ABSL_FLAG(std::string, qtxd, "", "qtxd binary to start with --device=cpu");
ABSL_FLAG(int, ops, 20000, "submissions per transport and round");
ABSL_FLAG(int, rounds, 5, "rounds of every transport");
ABSL_FLAG(int64_t, rows, 128, "rows of the [rows, 128] BF16 input");

namespace {

using Clock = std::chrono::steady_clock;

void SliceToProto(const qtx::RegionSlice& s, qtx::v1::RegionSlice* p) {
  p->set_region(s.region);
  p->set_offset(s.offset);
  p->set_size(s.size);
}

// The descriptor both transports carry.
qtx::v1::QuantizeRequest Descriptor(const qtx::Tensor& input, const qtx::QuantizeOutputs& outs,
                                    int64_t rows) {
  qtx::v1::QuantizeRequest r;
  r.mutable_input()->set_dtype(qtx::v1::BFLOAT16);
  r.mutable_input()->add_shape(rows);
  r.mutable_input()->add_shape(128);
  SliceToProto(*input.region, r.mutable_input()->mutable_region());
  r.mutable_config()->set_rowwise(true);
  SliceToProto(*outs.rowwise_data, r.mutable_outputs()->mutable_rowwise_data());
  SliceToProto(*outs.rowwise_scale_inv, r.mutable_outputs()->mutable_rowwise_scale_inv());
  return r;
}

// Outstanding async unary calls; each owns its context and reply until done.
class AsyncCalls {
 public:
  struct Call {
    grpc::ClientContext ctx;
    qtx::v1::QuantizeRequest req;
    qtx::v1::QuantizeResponse resp;
  };
  void Start(qtx::v1::Quantizer::Stub& stub, const qtx::v1::QuantizeRequest& req) {
    auto* call = new Call;
    call->req = req;
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
    }
    stub.async()->Quantize(&call->ctx, &call->req, &call->resp, [this, call](grpc::Status s) {
      if (!s.ok()) failed_.fetch_add(1);
      delete call;
      absl::MutexLock lock(&mu_);
      --pending_;
    });
  }
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* p) { return *p == 0; }, &pending_));
  }
  int failed() const { return failed_.load(); }

 private:
  absl::Mutex mu_;
  int pending_ = 0;
  std::atomic<int> failed_{0};
};

}  // namespace

int main(int argc, char** argv) {
  qtx::bench::ParseBenchFlags(argc, argv,
                              "submission_bench --qtxd=PATH: one gRPC stream per channel vs one "
                              "async unary call per op vs sync unary, same descriptor");
  const std::string qtxd = absl::GetFlag(FLAGS_qtxd);
  const int ops = absl::GetFlag(FLAGS_ops), rounds = absl::GetFlag(FLAGS_rounds);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  if (qtxd.empty() || ops <= 0 || rounds <= 0 || rows <= 0) {
    std::fprintf(
        stderr, "usage: submission_bench --qtxd=PATH [--ops=N] [--rounds=R] [--rows=M], all > 0\n");
    return 2;
  }
  auto server =
      qtx::testing::QtxdProcess::Start(qtxd, {"--device=cpu", "--allow_client_shm", "--threads=2"});
  QTX_BENCH_CHECK_OK(server.status());
  auto client = qtx::Client::Connect((*server)->target());
  QTX_BENCH_CHECK_OK(client.status());
  auto region = qtx::ShmRegion::Create("submission-bench", 8 << 20);
  QTX_BENCH_CHECK_OK(region.status());
  QTX_BENCH_CHECK_OK((*client)->RegisterShmRegion(**region));
  const std::string zeros(rows * 128 * 2, '\0');
  auto input = (*region)->Place(qtx::Tensor::Inline(qtx::DType::kBFloat16, {rows, 128}, zeros));
  QTX_BENCH_CHECK_OK(input.status());
  const std::vector<int64_t> shape = {rows, 128};
  auto outs = (*region)->AllocateQuantizeOutputs(shape, qtx::QuantizeConfig{});
  QTX_BENCH_CHECK_OK(outs.status());
  const qtx::v1::QuantizeRequest descriptor = Descriptor(*input, *outs, rows);

  grpc::ChannelArguments args;
  args.SetInt("qtx.submission_bench", 1);  // its own connection
  auto channel =
      grpc::CreateCustomChannel((*server)->target(), grpc::InsecureChannelCredentials(), args);
  auto stub = qtx::v1::Quantizer::NewStub(channel);

  std::vector<double> stream_us, unary_async_us, unary_sync_us;
  for (int round = 0; round < rounds; ++round) {
    // channel_stream
    {
      auto flags = qtx::HostChannelFlags::Create(**client, "submission-flags");
      QTX_BENCH_CHECK_OK(flags.status());
      auto ch = qtx::Channel::Open(**client, std::move(*flags));
      QTX_BENCH_CHECK_OK(ch.status());
      for (int i = 0; i < ops; ++i) {
        const auto t0 = Clock::now();
        auto id = (*ch)->Quantize(*input, qtx::QuantizeConfig{}, *outs);
        const auto t1 = Clock::now();
        QTX_BENCH_CHECK_OK(id.status());
        stream_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        // Bounded backlog: as a trainer whose host runs ahead of its device.
        if (i % 256 == 255) QTX_BENCH_CHECK_OK((*ch)->Synchronize());
      }
      QTX_BENCH_CHECK_OK((*ch)->Close());
    }
    // async_unary
    {
      AsyncCalls calls;
      for (int i = 0; i < ops; ++i) {
        const auto t0 = Clock::now();
        calls.Start(*stub, descriptor);
        const auto t1 = Clock::now();
        unary_async_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        if (i % 256 == 255) calls.Wait();
      }
      calls.Wait();
      if (calls.failed() != 0) {
        std::fprintf(stderr, "%d async unary calls failed\n", calls.failed());
        return 1;
      }
    }
    // sync_unary (reference: what a blocking call costs)
    for (int i = 0; i < std::min(ops, 2000); ++i) {
      grpc::ClientContext ctx;
      qtx::v1::QuantizeResponse resp;
      const auto t0 = Clock::now();
      const grpc::Status s = stub->Quantize(&ctx, descriptor, &resp);
      const auto t1 = Clock::now();
      if (!s.ok()) {
        std::fprintf(stderr, "sync Quantize: %s\n", s.error_message().c_str());
        return 1;
      }
      unary_sync_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }
  const double stream_p50 = qtx::bench::Percentile(stream_us, 0.5);
  auto line = [&](const char* transport, const std::vector<double>& v) {
    std::printf(
        "{\"bench\":\"submission\",\"transport\":\"%s\",\"rows\":%lld,\"calls\":%zu,"
        "\"host_us_p50\":%.2f,\"host_us_p99\":%.2f,\"p50_vs_channel_stream\":%.2f}\n",
        transport, static_cast<long long>(rows), v.size(), qtx::bench::Percentile(v, 0.5),
        qtx::bench::Percentile(v, 0.99), qtx::bench::Percentile(v, 0.5) / stream_p50);
  };
  line("channel_stream", stream_us);
  line("async_unary", unary_async_us);
  line("sync_unary", unary_sync_us);
  return 0;
}

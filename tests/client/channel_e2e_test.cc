// End-to-end: qtx::Channel against qtxd --device=cpu (--qtxd=<path>), flags
// in client shm (HostChannelFlags). Covers what a CPU can exercise of the
// stream-ordered protocol: ordering after the ready word, sequence numbers,
// byte-exact outputs against kernels::cpu::QuantizeBlock, failures (sticky,
// naming the operation, releasing the done word), qtxd dying with work in
// flight, a client going away with work parked on its ready word.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "qtx/v1/channel.grpc.pb.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;

std::string RandomBf16(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::string out(count * 2, '\0');
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t h = kernels::FloatToBf16(normal(rng) * (i % 7 == 0 ? 100.0f : 1.0f));
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

struct Expected {
  std::string rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv;
};

Expected QuantizeOnCpu(const std::string& bf16, int64_t m, int64_t n) {
  kernels::QuantizeParams p;
  p.rowwise = true;
  p.columnwise = true;
  const kernels::QuantizedLayout layout = kernels::ComputeLayout(p.scaling, m, n);
  Expected e;
  e.rowwise_data.assign(layout.RowwiseDataBytes(), '\0');
  e.rowwise_scale_inv.assign(layout.RowwiseScaleCount() * 4, '\0');
  e.columnwise_data.assign(layout.ColumnwiseDataBytes(), '\0');
  e.columnwise_scale_inv.assign(layout.ColumnwiseScaleCount() * 4, '\0');
  kernels::QuantizedBuffers out;
  out.rowwise_data = reinterpret_cast<uint8_t*>(e.rowwise_data.data());
  out.rowwise_scale_inv = reinterpret_cast<float*>(e.rowwise_scale_inv.data());
  out.columnwise_data = reinterpret_cast<uint8_t*>(e.columnwise_data.data());
  out.columnwise_scale_inv = reinterpret_cast<float*>(e.columnwise_scale_inv.data());
  kernels::cpu::QuantizeBlock(bf16.data(), kernels::InputDType::kBFloat16, m, n, p, out);
  return e;
}

std::string Bytes(const ShmRegion& region, const RegionSlice& slice) {
  absl::StatusOr<std::span<std::byte>> v = region.View(slice);
  EXPECT_TRUE(v.ok()) << v.status();
  if (!v.ok()) return {};
  return std::string(reinterpret_cast<const char*>(v->data()), v->size());
}

// "done", "pending" or the error of Channel::Query.
std::string State(const absl::StatusOr<bool>& q) {
  if (!q.ok()) return q.status().ToString();
  return *q ? "done" : "pending";
}

// Host flags whose "ready" the test writes by hand (Deliver), to model a
// caller whose stream reaches the operation later than the submission.
class DeferredFlags final : public ChannelFlags {
 public:
  explicit DeferredFlags(std::unique_ptr<HostChannelFlags> inner) : inner_(std::move(inner)) {}
  RegionSlice slice() const override { return inner_->slice(); }
  absl::Status SignalReady(uint64_t seq) override {
    last_.store(seq);
    return absl::OkStatus();
  }
  absl::Status WaitDone(uint64_t seq) override { return inner_->WaitDone(seq); }
  void ReleaseWaits(bool sidecar_gone) override { inner_->ReleaseWaits(sidecar_gone); }
  void Deliver() { (void)inner_->SignalReady(last_.load()); }  // host flags: always OK
  uint64_t ready() const { return inner_->ready(); }
  uint64_t done() const { return inner_->done(); }

 private:
  std::unique_ptr<HostChannelFlags> inner_;
  std::atomic<uint64_t> last_{0};
};

class ChannelE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    QTX_ASSERT_OK_AND_ASSIGN(
        server_, QtxdProcess::Start(g_qtxd_path, {"--device=cpu", "--allow_client_shm"}));
    QTX_ASSERT_OK_AND_ASSIGN(client_, Client::Connect(server_->target()));
    QTX_ASSERT_OK_AND_ASSIGN(region_, ShmRegion::Create("ch-data", 8 << 20));
    QTX_ASSERT_OK(client_->RegisterShmRegion(*region_));
  }

  // A quantization of a fresh [m, n] BF16 input placed in the region, with
  // every output in the region (pre-filled with a sentinel).
  struct Op {
    Tensor input;
    QuantizeOutputs outputs;
    Expected expected;
    std::string input_bytes;
  };
  Op MakeOp(int64_t m, int64_t n, uint64_t seed) {
    Op op;
    op.input_bytes = RandomBf16(m * n, seed);
    op.expected = QuantizeOnCpu(op.input_bytes, m, n);
    op.input = *region_->Place(Tensor::Inline(DType::kBFloat16, {m, n}, op.input_bytes));
    const std::vector<int64_t> shape = {m, n};
    op.outputs = *region_->AllocateQuantizeOutputs(shape, Config());
    for (const auto* s : {&op.outputs.rowwise_data, &op.outputs.rowwise_scale_inv,
                          &op.outputs.columnwise_data, &op.outputs.columnwise_scale_inv}) {
      std::span<std::byte> v = *region_->View(**s);
      std::memset(v.data(), 0xCD, v.size());
    }
    return op;
  }
  static QuantizeConfig Config() {
    QuantizeConfig c;
    c.columnwise = true;
    return c;
  }
  void ExpectOutputs(const Op& op) {
    EXPECT_TRUE(Bytes(*region_, *op.outputs.rowwise_data) == op.expected.rowwise_data);
    EXPECT_TRUE(Bytes(*region_, *op.outputs.rowwise_scale_inv) == op.expected.rowwise_scale_inv);
    EXPECT_TRUE(Bytes(*region_, *op.outputs.columnwise_data) == op.expected.columnwise_data);
    EXPECT_TRUE(Bytes(*region_, *op.outputs.columnwise_scale_inv) ==
                op.expected.columnwise_scale_inv);
  }

  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<ShmRegion> region_;
};

TEST_F(ChannelE2eTest, OperationsRunInOrderAndMatchTheReference) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  HostChannelFlags* raw = flags.get();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, Channel::Open(*client_, std::move(flags)));
  std::vector<Op> ops;
  const int64_t shapes[][2] = {{128, 256}, {200, 384}, {1, 128}, {129, 130}, {256, 128}};
  for (int i = 0; i < 20; ++i) {
    ops.push_back(MakeOp(shapes[i % 5][0], shapes[i % 5][1], 100 + i));
    QTX_ASSERT_OK_AND_ASSIGN(uint64_t id,
                             ch->Quantize(ops.back().input, Config(), ops.back().outputs));
    EXPECT_EQ(id, static_cast<uint64_t>(i + 1));
  }
  QTX_ASSERT_OK(ch->Synchronize());
  EXPECT_EQ(raw->ready(), 20u);
  EXPECT_EQ(raw->done(), 20u);
  for (uint64_t id = 1; id <= 20; ++id) EXPECT_EQ(State(ch->Query(id)), "done");
  for (const Op& op : ops) ExpectOutputs(op);
  // Dequantize on the channel too, into the region.
  QTX_ASSERT_OK_AND_ASSIGN(Tensor dq, region_->AllocateTensor(DType::kFloat32, {128, 256}));
  QuantizedTensor q;
  q.shape = {128, 256};
  q.source_dtype = DType::kBFloat16;
  q.config = Config();
  q.rowwise_data = Tensor::InRegion(DType::kFloat8E4M3, {128, 256}, *ops[0].outputs.rowwise_data);
  q.rowwise_scale_inv =
      Tensor::InRegion(DType::kFloat32, {128, 2}, *ops[0].outputs.rowwise_scale_inv);
  QTX_ASSERT_OK_AND_ASSIGN(uint64_t id, ch->Dequantize(q, DType::kFloat32, *dq.region));
  EXPECT_EQ(id, 21u);
  QTX_ASSERT_OK(ch->Close());
  QTX_ASSERT_OK_AND_ASSIGN(Tensor ref, client_->Dequantize(q, DType::kFloat32));
  EXPECT_TRUE(Bytes(*region_, *dq.region) == ref.data);
}

TEST_F(ChannelE2eTest, TheOpWaitsForTheReadyWord) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> inner,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  auto flags = std::make_unique<DeferredFlags>(std::move(inner));
  DeferredFlags* deferred = flags.get();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, Channel::Open(*client_, std::move(flags)));
  Op op = MakeOp(256, 256, 7);
  // The input is not written yet when the op is submitted: zeros now.
  std::span<std::byte> in = *region_->View(*op.input.region);
  std::memset(in.data(), 0, in.size());
  QTX_ASSERT_OK(ch->Quantize(op.input, Config(), op.outputs).status());
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(State(ch->Query(1)), "pending") << "ran before ready";
  EXPECT_EQ(deferred->done(), 0u);
  // The caller's "stream" produces the input, then reaches ready.
  std::memcpy(in.data(), op.input_bytes.data(), in.size());
  deferred->Deliver();
  QTX_ASSERT_OK(ch->Synchronize());
  EXPECT_EQ(deferred->done(), 1u);
  ExpectOutputs(op);
}

// Host flags that record, in a word the test owns (the flags die with the
// channel), how the channel released them: 0 never, 1 the caller's waits
// only, 2 the sidecar's waits too.
class ObservedFlags final : public ChannelFlags {
 public:
  ObservedFlags(std::unique_ptr<HostChannelFlags> inner, std::atomic<int>* released)
      : inner_(std::move(inner)), released_(released) {}
  RegionSlice slice() const override { return inner_->slice(); }
  absl::Status SignalReady(uint64_t seq) override { return inner_->SignalReady(seq); }
  absl::Status WaitDone(uint64_t seq) override { return inner_->WaitDone(seq); }
  void ReleaseWaits(bool sidecar_gone) override {
    released_->store(sidecar_gone ? 2 : 1);
    inner_->ReleaseWaits(sidecar_gone);
  }
  uint64_t done() const { return inner_->done(); }

 private:
  std::unique_ptr<HostChannelFlags> inner_;
  std::atomic<int>* released_;
};

TEST_F(ChannelE2eTest, AFailedOperationFailsTheChannelAndReleasesTheWaits) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> inner,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  std::atomic<int> released{0};
  auto flags = std::make_unique<ObservedFlags>(std::move(inner), &released);
  ObservedFlags* raw = flags.get();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, Channel::Open(*client_, std::move(flags)));
  Op good = MakeOp(128, 128, 1);
  QTX_ASSERT_OK(ch->Quantize(good.input, Config(), good.outputs).status());
  Tensor missing = good.input;
  missing.region->region = "no-such-region";
  QTX_ASSERT_OK(ch->Quantize(missing, Config(), good.outputs).status());  // fails at qtxd
  EXPECT_THAT(
      ch->Synchronize(),
      StatusIs(absl::StatusCode::kNotFound,
               HasSubstr("channel operation 2 failed: input.region: region 'no-such-region'")));
  EXPECT_EQ(raw->done(), kChannelFailedOffset + 2);  // releases every wait
  EXPECT_EQ(State(ch->Query(1)), "done");
  EXPECT_THAT(ch->Query(2), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(ch->Quantize(good.input, Config(), good.outputs),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("operation 2")));
  EXPECT_THAT(ch->Query(9), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  ExpectOutputs(good);
  EXPECT_THAT(ch->Close(), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  // qtxd is alive: the caller's waits are released, its ready word is left
  // to the caller's stream.
  EXPECT_EQ(released.load(), 1);
}

TEST_F(ChannelE2eTest, OperationsBehindAFailureAreNotRun) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> inner,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  auto flags = std::make_unique<DeferredFlags>(std::move(inner));
  DeferredFlags* deferred = flags.get();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, Channel::Open(*client_, std::move(flags)));
  Op op = MakeOp(128, 256, 3);
  QuantizeOutputs no_columnwise = op.outputs;
  no_columnwise.columnwise_data.reset();  // requested but not given: refused
  QTX_ASSERT_OK(ch->Quantize(op.input, Config(), no_columnwise).status());
  QTX_ASSERT_OK(ch->Quantize(op.input, Config(), op.outputs).status());
  deferred->Deliver();
  EXPECT_THAT(ch->Synchronize(), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("outputs.columnwise_data: not set")));
  EXPECT_THAT(ch->Query(2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("operation 2 was not run")));
  // The second op never wrote its outputs.
  const std::string untouched(op.expected.rowwise_data.size(), '\xCD');
  EXPECT_TRUE(Bytes(*region_, *op.outputs.rowwise_data) == untouched);
}

TEST_F(ChannelE2eTest, InlineTensorsAreRefusedAtOnce) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, Channel::Open(*client_, std::move(flags)));
  EXPECT_THAT(ch->Quantize(Tensor::Inline(DType::kBFloat16, {1, 128}, std::string(256, '\0')),
                           Config(), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inline")));
  EXPECT_EQ(ch->submitted(), 0u);
  QTX_ASSERT_OK(ch->Close());
}

TEST_F(ChannelE2eTest, OpenRefusesABadFlagArea) {
  // Wrong size: a 16-byte slice is required (Channel::Open sends the flags'
  // slice; a raw stream sends a bad one).
  auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
  auto stub = v1::StreamChannel::NewStub(channel);
  {
    grpc::ClientContext ctx;
    auto stream = stub->Connect(&ctx);
    v1::ChannelRequest open;
    open.mutable_open()->mutable_flags()->set_region("ch-data");
    open.mutable_open()->mutable_flags()->set_size(8);
    ASSERT_TRUE(stream->Write(open));
    v1::ChannelReply reply;
    EXPECT_FALSE(stream->Read(&reply));
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("open.flags.size=8"));
  }
  {
    grpc::ClientContext ctx;
    auto stream = stub->Connect(&ctx);
    v1::ChannelRequest submit;
    submit.mutable_submit()->set_seq(1);
    ASSERT_TRUE(stream->Write(submit));
    v1::ChannelReply reply;
    EXPECT_FALSE(stream->Read(&reply));
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("first message of a channel must be `open`"));
  }
  {
    grpc::ClientContext ctx;
    auto stream = stub->Connect(&ctx);
    v1::ChannelRequest open;
    open.mutable_open()->mutable_flags()->set_region("no-such-flags");
    open.mutable_open()->mutable_flags()->set_size(16);
    ASSERT_TRUE(stream->Write(open));
    v1::ChannelReply reply;
    EXPECT_FALSE(stream->Read(&reply));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(ChannelE2eTest, ASequenceGapFailsTheChannel) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                           HostChannelFlags::Create(*client_, "ch-raw"));
  QTX_ASSERT_OK(flags->SignalReady(5));
  auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
  auto stub = v1::StreamChannel::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Connect(&ctx);
  v1::ChannelRequest open;
  open.mutable_open()->mutable_flags()->set_region("ch-raw");
  open.mutable_open()->mutable_flags()->set_size(16);
  ASSERT_TRUE(stream->Write(open));
  v1::ChannelReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_opened());
  EXPECT_EQ(reply.opened().device(), "cpu");
  Op op = MakeOp(128, 128, 9);
  for (uint64_t seq : {1, 3}) {  // 2 is skipped
    v1::ChannelRequest submit;
    submit.mutable_submit()->set_seq(seq);
    v1::QuantizeRequest* q = submit.mutable_submit()->mutable_quantize();
    q->mutable_input()->set_dtype(v1::BFLOAT16);
    q->mutable_input()->add_shape(128);
    q->mutable_input()->add_shape(128);
    q->mutable_input()->mutable_region()->set_region("ch-data");
    q->mutable_input()->mutable_region()->set_offset(op.input.region->offset);
    q->mutable_input()->mutable_region()->set_size(op.input.region->size);
    q->mutable_outputs()->mutable_rowwise_data()->set_region("ch-data");
    q->mutable_outputs()->mutable_rowwise_data()->set_offset(op.outputs.rowwise_data->offset);
    q->mutable_outputs()->mutable_rowwise_data()->set_size(op.outputs.rowwise_data->size);
    q->mutable_outputs()->mutable_rowwise_scale_inv()->set_region("ch-data");
    q->mutable_outputs()->mutable_rowwise_scale_inv()->set_offset(
        op.outputs.rowwise_scale_inv->offset);
    q->mutable_outputs()->mutable_rowwise_scale_inv()->set_size(op.outputs.rowwise_scale_inv->size);
    ASSERT_TRUE(stream->Write(submit));
  }
  uint64_t failed = 0;
  while (failed == 0 && stream->Read(&reply)) {
    if (reply.has_progress()) {
      failed = reply.progress().failed_seq();
      if (failed != 0) {
        EXPECT_EQ(reply.progress().failed_code(), grpc::StatusCode::FAILED_PRECONDITION);
        EXPECT_THAT(reply.progress().failed_message(), HasSubstr("submit.seq=3: expected 2"));
      }
    }
  }
  EXPECT_EQ(failed, 3u);
  EXPECT_EQ(flags->done(), kChannelFailedOffset + 3);
  stream->WritesDone();
  while (stream->Read(&reply)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// ChannelOptions::background_writer: the descriptors are written by the
// channel's own thread, in the order of the calls; the results are the same,
// and the submission profile counts each call's parts.
TEST_F(ChannelE2eTest, BackgroundWriterKeepsTheOrderAndTheResults) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  HostChannelFlags* raw = flags.get();
  ChannelOptions options;
  options.background_writer = true;
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch,
                           Channel::Open(*client_, std::move(flags), options));
  SetChannelSubmitProfiling(true);
  (void)TakeChannelSubmitProfile();
  std::vector<Op> ops;
  const int64_t shapes[][2] = {{128, 256}, {200, 384}, {1, 128}, {129, 130}, {256, 128}};
  for (int i = 0; i < 40; ++i) {
    ops.push_back(MakeOp(shapes[i % 5][0], shapes[i % 5][1], 300 + i));
    QTX_ASSERT_OK_AND_ASSIGN(uint64_t id,
                             ch->Quantize(ops.back().input, Config(), ops.back().outputs));
    EXPECT_EQ(id, static_cast<uint64_t>(i + 1));
    // Every few calls, wait until qtxd has run everything: the next call
    // then finds no write in flight and wakes the writer thread.
    if (i % 7 == 6) QTX_ASSERT_OK(ch->Synchronize());
  }
  SetChannelSubmitProfiling(false);
  const ChannelSubmitProfile prof = TakeChannelSubmitProfile();
  EXPECT_EQ(prof.calls, 40u);
  EXPECT_GT(prof.check_ns + prof.build_ns + prof.signal_ns + prof.enqueue_ns + prof.wait_ns, 0u);
  QTX_ASSERT_OK(ch->Synchronize());
  EXPECT_EQ(raw->ready(), 40u);
  EXPECT_EQ(raw->done(), 40u);
  for (const Op& op : ops) ExpectOutputs(op);
  QTX_ASSERT_OK(ch->Close());
  EXPECT_EQ(TakeChannelSubmitProfile().calls, 0u);  // off: nothing counted, and cleared
}

TEST_F(ChannelE2eTest, BackgroundWriterChannelFailsCleanlyWhenQtxdDies) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> inner,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  auto flags = std::make_unique<DeferredFlags>(std::move(inner));
  DeferredFlags* deferred = flags.get();
  ChannelOptions options;
  options.background_writer = true;
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch,
                           Channel::Open(*client_, std::move(flags), options));
  Op op = MakeOp(128, 128, 6);
  QTX_ASSERT_OK(ch->Quantize(op.input, Config(), op.outputs).status());  // parked: no ready
  ASSERT_EQ(::kill(server_->pid(), SIGKILL), 0);
  const absl::Time start = absl::Now();
  while (deferred->done() != kChannelReleaseAll && absl::Now() - start < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(deferred->done(), kChannelReleaseAll);
  EXPECT_THAT(ch->Quantize(op.input, Config(), op.outputs),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  ch.reset();  // joins the writer thread; must not hang
}

TEST_F(ChannelE2eTest, QtxdDyingReleasesTheWaitsAndLaterCallsFail) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> inner,
                           HostChannelFlags::Create(*client_, "ch-flags"));
  auto flags = std::make_unique<DeferredFlags>(std::move(inner));
  DeferredFlags* deferred = flags.get();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, Channel::Open(*client_, std::move(flags)));
  Op op = MakeOp(128, 128, 5);
  QTX_ASSERT_OK(ch->Quantize(op.input, Config(), op.outputs).status());  // parked: no ready
  ASSERT_EQ(::kill(server_->pid(), SIGKILL), 0);
  const absl::Time start = absl::Now();
  while (deferred->done() != kChannelReleaseAll && absl::Now() - start < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(deferred->done(), kChannelReleaseAll);
  // ready too, so that work the dead qtxd left parked on it can drain.
  EXPECT_EQ(deferred->ready(), kChannelReleaseAll);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "waits released too late";
  EXPECT_THAT(ch->Quantize(op.input, Config(), op.outputs),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(ch->Synchronize(), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(ch->Query(1), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  ch.reset();  // must not hang
}

TEST_F(ChannelE2eTest, AClientGoneWithParkedWorkLeavesQtxdServing) {
  {
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> inner,
                             HostChannelFlags::Create(*client_, "ch-flags"));
    auto flags = std::make_unique<DeferredFlags>(std::move(inner));
    ChannelOptions options;
    options.sync_timeout = absl::Milliseconds(200);
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch,
                             Channel::Open(*client_, std::move(flags), options));
    Op op = MakeOp(128, 128, 5);
    QTX_ASSERT_OK(ch->Quantize(op.input, Config(), op.outputs).status());  // never ready
    EXPECT_THAT(ch->Close(), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  }
  // qtxd let the parked op through and still serves, channels included.
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                           HostChannelFlags::Create(*client_, "ch-flags2"));
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, Channel::Open(*client_, std::move(flags)));
  Op op = MakeOp(128, 128, 6);
  QTX_ASSERT_OK(ch->Quantize(op.input, Config(), op.outputs).status());
  QTX_ASSERT_OK(ch->Close());
  ExpectOutputs(op);
  // Nothing stays pinned once both channels are gone (the cancelled one
  // closes on qtxd's side asynchronously: allow it a few seconds).
  uint32_t pinned = 1;
  for (int i = 0; i < 500 && pinned != 0; ++i) {
    QTX_ASSERT_OK_AND_ASSIGN(std::vector<RegionInfo> regions, client_->ListRegions());
    pinned = 0;
    for (const RegionInfo& r : regions) pinned += r.in_use;
    if (pinned != 0) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(pinned, 0u);
}

// Two CPU sidecars in a Gloo group, each driven through its own channel: the
// AllGather of unaligned shards (straddling 128-row blocks) equals
// QuantizeBlock of the concatenation, byte for byte, on both ranks. Both
// submissions return at once from one thread (asynchronous), and a channel
// that did not take part would make the other fail: they are one collective.
// Waits (host) until the done word reaches `n` (as a GEQ stream wait
// compares) or 30 s pass.
bool AwaitDone(const HostChannelFlags& flags, uint64_t n) {
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (static_cast<int64_t>(flags.done() - n) < 0) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Microseconds(50));
  }
  return true;
}

// A plan (what a replayed CUDA graph drives): the caller only moves the
// ready word, once per execution, with a new input each time; qtxd runs
// the fixed op for each, in order, never before its ready.
TEST_F(ChannelE2eTest, PlanRunsOncePerExecutionWithoutSubmissions) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                           HostChannelFlags::Create(*client_, "plan-flags"));
  HostChannelFlags* raw = flags.get();
  Op op = MakeOp(200, 384, 1);
  std::span<std::byte> in = *region_->View(*op.input.region);
  QTX_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<Channel> plan,
      Channel::OpenPlan(*client_, std::move(flags), QuantizePlan{op.input, Config(), op.outputs},
                        {.label = "plan"}, /*lookahead=*/3));
  EXPECT_TRUE(plan->is_plan());
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(raw->done(), 0u) << "an execution ran before its ready";
  for (uint64_t n = 1; n <= 12; ++n) {
    const std::string input = RandomBf16(200 * 384, 1000 + n);
    std::memcpy(in.data(), input.data(), in.size());
    QTX_ASSERT_OK(raw->SignalReady(n));
    ASSERT_TRUE(AwaitDone(*raw, n)) << "execution " << n;
    EXPECT_EQ(raw->done(), n);
    Op expected = op;
    expected.expected = QuantizeOnCpu(input, 200, 384);
    ExpectOutputs(expected);
  }
  QTX_EXPECT_OK(plan->status());
  EXPECT_GE(plan->completed(), 11u);  // progress messages may trail the done word
  // A plan takes no submissions.
  EXPECT_THAT(plan->Quantize(op.input, Config(), op.outputs),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is a plan")));
  QTX_ASSERT_OK(plan->Close());
  EXPECT_THAT(plan->status(), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
}

TEST_F(ChannelE2eTest, APlanWhoseOpIsBadFailsAtItsFirstExecution) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                           HostChannelFlags::Create(*client_, "plan-flags"));
  HostChannelFlags* raw = flags.get();
  Op op = MakeOp(128, 128, 2);
  Tensor missing = op.input;
  missing.region->region = "no-such-region";
  QTX_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<Channel> plan,
      Channel::OpenPlan(*client_, std::move(flags), QuantizePlan{missing, Config(), op.outputs}));
  QTX_ASSERT_OK(raw->SignalReady(1));
  ASSERT_TRUE(AwaitDone(*raw, 1));
  EXPECT_EQ(raw->done(), kChannelFailedOffset + 1);  // released, marked failed
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (plan->status().ok() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_THAT(plan->status(), StatusIs(absl::StatusCode::kNotFound,
                                       HasSubstr("channel operation 1 failed: input.region: region "
                                                 "'no-such-region'")));
  EXPECT_THAT(Channel::OpenPlan(*client_, nullptr, QuantizePlan{op.input, Config(), op.outputs}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("flags is null")));
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> more,
                           HostChannelFlags::Create(*client_, "plan-flags-2"));
  EXPECT_THAT(Channel::OpenPlan(*client_, std::move(more),
                                QuantizePlan{op.input, Config(), op.outputs}, {}, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lookahead=0")));
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> too_many,
                           HostChannelFlags::Create(*client_, "plan-flags-3"));
  EXPECT_THAT(
      Channel::OpenPlan(*client_, std::move(too_many), QuantizePlan{op.input, Config(), op.outputs},
                        {}, 17),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lookahead=17: must be 1..16")));
}

// The server refuses a submission on a plan channel (a raw stream: the
// client library refuses it before sending) and a plan with a bad lookahead.
TEST_F(ChannelE2eTest, ServerRefusesSubmissionsOnAPlanAndBadLookaheads) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> flags, ShmRegion::Create("raw-plan", 4096));
  QTX_ASSERT_OK(client_->RegisterShmRegion(*flags));
  Op op = MakeOp(128, 128, 4);
  auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
  auto stub = v1::StreamChannel::NewStub(channel);
  auto plan_open = [&](uint32_t lookahead) {
    v1::ChannelRequest open;
    open.mutable_open()->mutable_flags()->set_region("raw-plan");
    open.mutable_open()->mutable_flags()->set_size(16);
    v1::ChannelPlan* p = open.mutable_open()->mutable_plan();
    p->set_lookahead(lookahead);
    v1::QuantizeRequest* q = p->mutable_quantize();
    q->mutable_input()->set_dtype(v1::BFLOAT16);
    q->mutable_input()->add_shape(128);
    q->mutable_input()->add_shape(128);
    q->mutable_input()->mutable_region()->set_region(op.input.region->region);
    q->mutable_input()->mutable_region()->set_offset(op.input.region->offset);
    q->mutable_input()->mutable_region()->set_size(op.input.region->size);
    q->mutable_config()->set_rowwise(true);
    q->mutable_outputs()->mutable_rowwise_data()->set_region(op.outputs.rowwise_data->region);
    q->mutable_outputs()->mutable_rowwise_data()->set_offset(op.outputs.rowwise_data->offset);
    q->mutable_outputs()->mutable_rowwise_data()->set_size(op.outputs.rowwise_data->size);
    q->mutable_outputs()->mutable_rowwise_scale_inv()->set_region(
        op.outputs.rowwise_scale_inv->region);
    q->mutable_outputs()->mutable_rowwise_scale_inv()->set_offset(
        op.outputs.rowwise_scale_inv->offset);
    q->mutable_outputs()->mutable_rowwise_scale_inv()->set_size(op.outputs.rowwise_scale_inv->size);
    return open;
  };
  {
    grpc::ClientContext ctx;
    auto stream = stub->Connect(&ctx);
    ASSERT_TRUE(stream->Write(plan_open(17)));
    v1::ChannelReply reply;
    EXPECT_FALSE(stream->Read(&reply));
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("open.plan.lookahead=17"));
  }
  {
    grpc::ClientContext ctx;
    auto stream = stub->Connect(&ctx);
    ASSERT_TRUE(stream->Write(plan_open(1)));
    v1::ChannelReply reply;
    ASSERT_TRUE(stream->Read(&reply));
    EXPECT_TRUE(reply.has_opened());
    v1::ChannelRequest submit;
    submit.mutable_submit()->set_seq(1);
    ASSERT_TRUE(stream->Write(submit));
    while (stream->Read(&reply)) {
    }
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("this channel is a plan"));
  }
}

TEST(ChannelCollectiveE2e, AllGatherThroughChannelsMatchesQuantizeOfTheConcatenation) {
  constexpr int kWorld = 2;
  const int64_t rows[kWorld] = {100, 157};
  const int64_t n = 256, m = rows[0] + rows[1];
  const std::string all = RandomBf16(m * n, 77);
  const Expected expected = QuantizeOnCpu(all, m, n);
  std::unique_ptr<QtxdProcess> servers[kWorld];
  std::unique_ptr<Client> clients[kWorld];
  std::unique_ptr<ShmRegion> regions[kWorld];
  for (int r = 0; r < kWorld; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(
        servers[r], QtxdProcess::Start(g_qtxd_path, {"--device=cpu", "--allow_client_shm"}));
    QTX_ASSERT_OK_AND_ASSIGN(clients[r], Client::Connect(servers[r]->target()));
    QTX_ASSERT_OK_AND_ASSIGN(regions[r], ShmRegion::Create("ag-" + std::to_string(r), 4 << 20));
    QTX_ASSERT_OK(clients[r]->RegisterShmRegion(*regions[r]));
  }
  absl::StatusOr<CollectiveGroupInfo> infos[kWorld];
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      CollectiveGroupConfig c;
      c.name = "tp";
      c.rank = r;
      c.world_size = kWorld;
      c.coordinator = r == 0 ? "" : servers[0]->target();
      c.backend = CommBackend::kGloo;
      c.timeout = absl::Seconds(30);
      infos[r] = clients[r]->CreateGroup(c);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) QTX_ASSERT_OK(infos[r].status());

  QuantizeConfig config;
  config.columnwise = true;
  std::unique_ptr<Channel> channels[kWorld];
  QuantizeOutputs outs[kWorld];
  int64_t offset = 0;
  for (int r = 0; r < kWorld; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                             HostChannelFlags::Create(*clients[r], "ag-flags"));
    QTX_ASSERT_OK_AND_ASSIGN(channels[r], Channel::Open(*clients[r], std::move(flags)));
    const std::string shard = all.substr(offset * n * 2, rows[r] * n * 2);
    offset += rows[r];
    QTX_ASSERT_OK_AND_ASSIGN(
        Tensor in, regions[r]->Place(Tensor::Inline(DType::kBFloat16, {rows[r], n}, shard)));
    const std::vector<int64_t> gathered = {m, n};
    QTX_ASSERT_OK_AND_ASSIGN(outs[r], regions[r]->AllocateQuantizeOutputs(gathered, config));
    QTX_ASSERT_OK_AND_ASSIGN(
        uint64_t id,
        channels[r]->AllGather("tp", 0, in, config, AllGatherMode::kExactFp8, outs[r]));
    EXPECT_EQ(id, 1u);
  }
  for (int r = 0; r < kWorld; ++r) {
    QTX_ASSERT_OK(channels[r]->Synchronize());
    EXPECT_TRUE(Bytes(*regions[r], *outs[r].rowwise_data) == expected.rowwise_data) << r;
    EXPECT_TRUE(Bytes(*regions[r], *outs[r].rowwise_scale_inv) == expected.rowwise_scale_inv) << r;
    EXPECT_TRUE(Bytes(*regions[r], *outs[r].columnwise_data) == expected.columnwise_data) << r;
    EXPECT_TRUE(Bytes(*regions[r], *outs[r].columnwise_scale_inv) == expected.columnwise_scale_inv)
        << r;
  }
  // A channel AllGather without outputs fails on every rank (it still joins
  // the collective, so neither waits for the deadline).
  for (int r = 0; r < kWorld; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(Tensor in, regions[r]->AllocateTensor(DType::kBFloat16, {rows[r], n}));
    QuantizeOutputs partial = outs[r];
    if (r == 1) partial.columnwise_scale_inv.reset();
    QTX_ASSERT_OK(
        channels[r]->AllGather("tp", 1, in, config, AllGatherMode::kExactFp8, partial).status());
  }
  EXPECT_THAT(channels[1]->Synchronize(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("all_gather.outputs.columnwise_scale_inv: not set")));
  EXPECT_THAT(channels[0]->Synchronize(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("columnwise_scale_inv")));

  // One round (shard_rows on every rank): the same bytes, through fresh
  // channels (the ones above failed for good). The outputs are zeroed
  // first, so bytes left from the call above cannot pass.
  const std::vector<int64_t> shard_rows = {rows[0], rows[1]};
  Tensor ins[kWorld];
  offset = 0;
  for (int r = 0; r < kWorld; ++r) {
    QTX_ASSERT_OK_AND_ASSIGN(
        ins[r], regions[r]->Place(Tensor::Inline(DType::kBFloat16, {rows[r], n},
                                                 all.substr(offset * n * 2, rows[r] * n * 2))));
    offset += rows[r];
  }
  auto reopen = [&](const std::string& label) {
    for (int r = 0; r < kWorld; ++r) {
      channels[r].reset();
      QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostChannelFlags> flags,
                               HostChannelFlags::Create(*clients[r], "ag-flags-" + label));
      QTX_ASSERT_OK_AND_ASSIGN(channels[r], Channel::Open(*clients[r], std::move(flags)));
    }
  };
  // Zeroes the outputs, runs group call `seq` in one round on every rank,
  // checks every byte.
  auto one_round_exact = [&](uint64_t seq) {
    for (int r = 0; r < kWorld; ++r) {
      for (const auto* o : {&outs[r].rowwise_data, &outs[r].rowwise_scale_inv,
                            &outs[r].columnwise_data, &outs[r].columnwise_scale_inv}) {
        QTX_ASSERT_OK_AND_ASSIGN(std::span<std::byte> v, regions[r]->View(**o));
        std::memset(v.data(), 0, v.size());
      }
      QTX_ASSERT_OK(
          channels[r]
              ->AllGather("tp", seq, ins[r], config, AllGatherMode::kExactFp8, outs[r], shard_rows)
              .status());
    }
    for (int r = 0; r < kWorld; ++r) {
      QTX_ASSERT_OK(channels[r]->Synchronize());
      EXPECT_TRUE(Bytes(*regions[r], *outs[r].rowwise_data) == expected.rowwise_data) << r;
      EXPECT_TRUE(Bytes(*regions[r], *outs[r].rowwise_scale_inv) == expected.rowwise_scale_inv)
          << r;
      EXPECT_TRUE(Bytes(*regions[r], *outs[r].columnwise_data) == expected.columnwise_data) << r;
      EXPECT_TRUE(Bytes(*regions[r], *outs[r].columnwise_scale_inv) ==
                  expected.columnwise_scale_inv)
          << r;
    }
  };
  ASSERT_NO_FATAL_FAILURE(reopen("one-round"));
  ASSERT_NO_FATAL_FAILURE(one_round_exact(2));
  // Ranks that disagree (amax_epsilon, which keeps the slot size): the
  // check runs with the op's device work, not before it returns; the op is
  // never reported done and both channels fail naming field and rank. The
  // channel's later operations are not run.
  {
    uint64_t ids[kWorld] = {};
    for (int r = 0; r < kWorld; ++r) {
      QuantizeConfig c = config;
      if (r == 1) c.amax_epsilon = 1e-3f;
      QTX_ASSERT_OK_AND_ASSIGN(
          ids[r], channels[r]->AllGather("tp", 3, ins[r], c, AllGatherMode::kExactFp8, outs[r],
                                         shard_rows));
    }
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_THAT(channels[r]->Synchronize(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("ranks disagree on config.amax_epsilon: rank 0 has 0, rank 1 "
                                     "has 0.001")))
          << r;
      EXPECT_THAT(channels[r]->Query(ids[r]),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("amax_epsilon")))
          << r;
      EXPECT_EQ(channels[r]->completed(), ids[r] - 1) << r;
      EXPECT_THAT(
          channels[r]
              ->AllGather("tp", 4, ins[r], config, AllGatherMode::kExactFp8, outs[r], shard_rows)
              .status(),
          StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("amax_epsilon")))
          << r;
    }
  }
  // A rank whose own request is bad (an output in a region qtxd does not
  // know): it fails at once, the other from its slot check ("rank 1
  // rejected its request"). The group sequence 4 was never run above (the
  // channels had failed), so it is next.
  ASSERT_NO_FATAL_FAILURE(reopen("rejected"));
  for (int r = 0; r < kWorld; ++r) {
    QuantizeOutputs o = outs[r];
    if (r == 1) o.columnwise_data->region = "no-such-region";
    QTX_ASSERT_OK(channels[r]
                      ->AllGather("tp", 4, ins[r], config, AllGatherMode::kExactFp8, o, shard_rows)
                      .status());
  }
  EXPECT_THAT(channels[1]->Synchronize(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no-such-region")));
  EXPECT_THAT(channels[0]->Synchronize(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank 1 rejected its request")));
  // And the group still works, in one round.
  ASSERT_NO_FATAL_FAILURE(reopen("after"));
  ASSERT_NO_FATAL_FAILURE(one_round_exact(5));
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}

// qtx::Client behaviour that needs no server: argument checks and failures
// against a socket nobody listens on. The end-to-end test is client_e2e_test.
#include "qtx/client.h"

#include <unistd.h>

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string DeadSocket() {
  return "/tmp/qtx-client-test-nobody-" + std::to_string(getpid()) + ".sock";
}

TEST(ClientTest, ConnectRejectsBadArguments) {
  EXPECT_THAT(Client::Connect(""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target")));
  ClientOptions o;
  o.max_message_bytes = 0;
  EXPECT_THAT(Client::Connect("unix:///tmp/x.sock", o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_message_bytes")));
  o = {};
  o.timeout = absl::ZeroDuration();
  EXPECT_THAT(Client::Connect("unix:///tmp/x.sock", o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
}

TEST(ClientTest, NormalizesTargets) {
  QTX_ASSERT_OK_AND_ASSIGN(auto a, Client::Connect("/run/qtxd.sock"));
  EXPECT_EQ(a->target(), "unix:///run/qtxd.sock");
  QTX_ASSERT_OK_AND_ASSIGN(auto b, Client::Connect("localhost:50051"));
  EXPECT_EQ(b->target(), "localhost:50051");
  QTX_ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(kDefaultTarget));
  EXPECT_EQ(c->target(), kDefaultTarget);
}

TEST(ClientTest, UnreachableServerIsUnavailable) {
  QTX_ASSERT_OK_AND_ASSIGN(auto client, Client::Connect(DeadSocket()));
  EXPECT_THAT(client->Health(), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(client->ListRegions(), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(client->UnregisterRegion("r"),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

TEST(ClientTest, ConnectTimeoutFailsFast) {
  ClientOptions o;
  o.connect_timeout = absl::Milliseconds(200);
  EXPECT_THAT(Client::Connect(DeadSocket(), o),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("could not connect")));
}

TEST(ClientTest, WaitForReadyHitsTheDeadline) {
  ClientOptions o;
  o.wait_for_ready = true;
  o.timeout = absl::Milliseconds(300);
  QTX_ASSERT_OK_AND_ASSIGN(auto client, Client::Connect(DeadSocket(), o));
  const absl::Time start = absl::Now();
  EXPECT_THAT(client->ListRegions(), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  CallOptions call;
  call.timeout = absl::Milliseconds(50);
  EXPECT_THAT(client->Health("", call),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
}

TEST(ClientTest, WaitUntilServingTimesOut) {
  QTX_ASSERT_OK_AND_ASSIGN(auto client, Client::Connect(DeadSocket()));
  EXPECT_THAT(client->WaitUntilServing(absl::Milliseconds(300)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("not SERVING")));
}

}  // namespace
}  // namespace qtx

// The qtxd executable: starts on a temporary socket, serves, and on SIGTERM
// or SIGINT stops, removes its socket and exits 0.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/subprocess.h"

namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::Subprocess;

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

void RunAndStop(int signal_number) {
  absl::StatusOr<std::unique_ptr<QtxdProcess>> qtxd =
      QtxdProcess::Start(QTXD_PATH, {"--threads=1", "--shutdown_grace_s=1"});
  ASSERT_TRUE(qtxd.ok()) << qtxd.status();
  const std::string socket = (*qtxd)->socket_path();
  ASSERT_TRUE(Exists(socket)) << "qtxd did not create " << socket;

  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = qtx::v1::Memory::NewStub(channel);
  qtx::v1::ListRegionsResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ctx.set_wait_for_ready(true);
  grpc::Status s = stub->ListRegions(&ctx, qtx::v1::ListRegionsRequest(), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();

  const absl::StatusOr<int> exit_status = (*qtxd)->Stop(absl::Seconds(20), signal_number);
  ASSERT_TRUE(exit_status.ok()) << "qtxd did not exit after the signal: " << exit_status.status();
  EXPECT_EQ(*exit_status, 0);
  EXPECT_FALSE(Exists(socket)) << "the socket file was left behind";
}

TEST(Qtxd, SigtermStopsCleanly) { RunAndStop(SIGTERM); }
TEST(Qtxd, SigintStopsCleanly) { RunAndStop(SIGINT); }

TEST(Qtxd, BadFlagsExitNonZeroWithAClearMessage) {
  absl::StatusOr<std::unique_ptr<Subprocess>> qtxd =
      Subprocess::Start({QTXD_PATH, "--listen_tcp=0.0.0.0:1", "--socket="});
  ASSERT_TRUE(qtxd.ok()) << qtxd.status();
  const absl::StatusOr<int> status = (*qtxd)->Wait(absl::Seconds(20));
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 1);
}

}  // namespace

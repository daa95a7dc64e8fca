// The qtxd executable: starts on a temporary socket, serves, and on SIGTERM
// or SIGINT stops, removes its socket and exits 0.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "qtx/v1/memory.grpc.pb.h"

namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// Waits for `pid` up to `timeout`; returns its wait status or -1.
int WaitFor(pid_t pid, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

void RunAndStop(int signal_number) {
  char tmpl[] = "/tmp/qtxd-main-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string socket = dir + "/qtxd.sock";
  const std::string socket_flag = "--socket=" + socket;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl(QTXD_PATH, QTXD_PATH, socket_flag.c_str(), "--threads=1", "--log_level=warn",
            "--shutdown_grace_s=1", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  for (int i = 0; i < 500 && !Exists(socket); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(Exists(socket)) << "qtxd did not create " << socket;

  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = qtx::v1::Memory::NewStub(channel);
  qtx::v1::ListRegionsResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ctx.set_wait_for_ready(true);
  grpc::Status s = stub->ListRegions(&ctx, qtx::v1::ListRegionsRequest(), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();

  ASSERT_EQ(::kill(pid, signal_number), 0);
  const int status = WaitFor(pid, std::chrono::seconds(20));
  if (status == -1) ::kill(pid, SIGKILL), ::waitpid(pid, nullptr, 0);
  ASSERT_NE(status, -1) << "qtxd did not exit after the signal";
  EXPECT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_FALSE(Exists(socket)) << "the socket file was left behind";
  ::rmdir(dir.c_str());
}

TEST(Qtxd, SigtermStopsCleanly) { RunAndStop(SIGTERM); }
TEST(Qtxd, SigintStopsCleanly) { RunAndStop(SIGINT); }

TEST(Qtxd, BadFlagsExitNonZeroWithAClearMessage) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl(QTXD_PATH, QTXD_PATH, "--listen_tcp=0.0.0.0:1",
            "--socket=", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const int status = WaitFor(pid, std::chrono::seconds(20));
  ASSERT_NE(status, -1);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

}  // namespace

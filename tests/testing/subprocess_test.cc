// Subprocess, the one way tests start processes: exit statuses, exec errors,
// the stdout pipe, and that a child dies with a test that crashes (a qtxd left
// running would hold CTest's output pipe until the test's timeout).
#include "tests/testing/subprocess.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kChildModeEnv[] = "QTX_SUBPROCESS_TEST_CHILD";

// Reads the child's whole stdout.
std::string ReadAll(int fd) {
  std::string out;
  char buf[256];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

// Whether `pid` is gone or a zombie (killed, not yet reaped by its new parent).
bool Dead(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

TEST(Subprocess, ReportsTheExitStatus) {
  QTX_ASSERT_OK_AND_ASSIGN(auto p, Subprocess::Start({"/bin/sh", "-c", "exit 3"}));
  QTX_ASSERT_OK_AND_ASSIGN(int status, p->Wait(absl::Seconds(30)));
  EXPECT_EQ(ExitCode(status), 3);
  EXPECT_FALSE(p->alive());
}

TEST(Subprocess, AMissingExecutableFailsWithTheExecError) {
  EXPECT_THAT(Subprocess::Start({"/nonexistent/qtxd"}),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("No such file or directory")));
  EXPECT_THAT(Subprocess::Start({"/dev/null"}),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("Permission denied")));
}

TEST(Subprocess, PipesStdoutAndSilencesWhenQuiet) {
  Subprocess::Options o;
  o.pipe_stdout = true;
  o.quiet = true;  // stderr to /dev/null, stdout still to the pipe
  QTX_ASSERT_OK_AND_ASSIGN(auto p,
                           Subprocess::Start({"/bin/sh", "-c", "echo out; echo err >&2"}, o));
  EXPECT_EQ(ReadAll(p->stdout_fd()), "out\n");
  QTX_ASSERT_OK_AND_ASSIGN(int status, p->Wait(absl::Seconds(30)));
  EXPECT_EQ(ExitCode(status), 0);
}

// This binary again, in the child mode (main below): it starts `sleep 600`
// with die_with_parent as given, prints the sleeper's pid and aborts.
// Returns the sleeper's pid once the crashed child has been reaped.
pid_t SleeperOfACrashedTest(bool die_with_parent) {
  ::setenv(kChildModeEnv, die_with_parent ? "die" : "stay", 1);
  Subprocess::Options o;
  o.pipe_stdout = true;
  absl::StatusOr<std::unique_ptr<Subprocess>> crasher = Subprocess::Start({"/proc/self/exe"}, o);
  ::unsetenv(kChildModeEnv);
  EXPECT_TRUE(crasher.ok()) << crasher.status();
  if (!crasher.ok()) return -1;
  const std::string out = ReadAll((*crasher)->stdout_fd());
  absl::StatusOr<int> status = (*crasher)->Wait(absl::Seconds(30));
  EXPECT_TRUE(status.ok() && WIFSIGNALED(*status) && WTERMSIG(*status) == SIGABRT)
      << "the child mode should abort: " << out;
  int pid = -1;
  EXPECT_TRUE(absl::SimpleAtoi(out, &pid) && pid > 0) << "child mode printed '" << out << "'";
  return pid;
}

TEST(Subprocess, AChildDiesWithATestThatCrashed) {
  const pid_t sleeper = SleeperOfACrashedTest(/*die_with_parent=*/true);
  ASSERT_GT(sleeper, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!Dead(sleeper) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(Dead(sleeper)) << "pid " << sleeper << " outlived the test that started it";
  if (!Dead(sleeper)) ::kill(sleeper, SIGKILL);
}

// The same without die_with_parent: the child is left running (what the
// option prevents), so the test above can fail.
TEST(Subprocess, WithoutDieWithParentAChildOutlivesTheCrash) {
  const pid_t sleeper = SleeperOfACrashedTest(/*die_with_parent=*/false);
  ASSERT_GT(sleeper, 0);
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(Dead(sleeper));
  ::kill(sleeper, SIGKILL);
}

}  // namespace
}  // namespace qtx::testing

int main(int argc, char** argv) {
  const char* mode = std::getenv(qtx::testing::kChildModeEnv);
  if (mode != nullptr) {
    qtx::testing::Subprocess::Options o;
    o.die_with_parent = std::string(mode) == "die";
    o.quiet = true;  // else the sleeper holds the parent's pipe, and ReadAll waits for it
    auto sleeper = qtx::testing::Subprocess::Start({"/bin/sleep", "600"}, o);
    if (!sleeper.ok()) return 2;
    std::printf("%d", static_cast<int>((*sleeper)->pid()));
    std::fflush(stdout);
    const struct rlimit no_core = {0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);  // no core file from the abort
    std::abort();  // a crash: no destructor runs, the Subprocess is not killed
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

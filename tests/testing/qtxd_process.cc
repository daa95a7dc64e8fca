#include "tests/testing/qtxd_process.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "qtx/client.h"

extern char** environ;

namespace qtx::testing {

absl::StatusOr<std::unique_ptr<QtxdProcess>> QtxdProcess::Start(
    const std::string& qtxd_path, const std::vector<std::string>& extra_args,
    absl::Duration timeout, const ClientOptions& probe) {
  char dir_template[] = "/tmp/qtx-e2e-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  const std::string dir = dir_template;
  const std::string socket_path = dir + "/qtxd.sock";
  std::vector<std::string> args = {qtxd_path, "--socket=" + socket_path, "--log_level=warn"};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, qtxd_path.c_str(), nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    std::filesystem::remove_all(dir);
    return absl::InternalError(absl::StrCat("posix_spawn ", qtxd_path, ": ", std::strerror(rc)));
  }
  std::unique_ptr<QtxdProcess> process(new QtxdProcess(pid, dir, socket_path));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(process->target(), probe);
  if (!client.ok()) return client.status();
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      process->pid_ = -1;
      return absl::InternalError(absl::StrCat("qtxd exited during startup with status ",
                                              WIFEXITED(status) ? WEXITSTATUS(status) : -1));
    }
    last = (*client)->WaitUntilServing(absl::Milliseconds(200));
    if (last.ok()) return process;
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "qtxd not serving after ", absl::FormatDuration(timeout), ": ", last.ToString()));
}

absl::StatusOr<int> QtxdProcess::Stop(absl::Duration grace) {
  if (pid_ < 0) return absl::FailedPreconditionError("qtxd already stopped");
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) break;
    if (absl::Now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      pid_ = -1;
      return absl::DeadlineExceededError("qtxd ignored SIGTERM; killed");
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

QtxdProcess::~QtxdProcess() {
  if (pid_ >= 0) Stop().IgnoreError();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string QtxdFlagOrExit(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--qtxd=") && arg.size() > 7) return std::string(arg.substr(7));
  }
  std::fprintf(stderr, "usage: %s --qtxd=<path to qtxd> [gtest flags]\n",
               argc > 0 ? argv[0] : "test");
  std::exit(2);
}

}  // namespace qtx::testing

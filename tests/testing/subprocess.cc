#include "tests/testing/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace qtx::testing {
namespace {

// In the child: writes errno to `report` and exits 127.
[[noreturn]] void ChildFailed(int report) {
  const int e = errno;
  (void)!::write(report, &e, sizeof(e));
  ::_exit(127);
}

// In the child, between fork and exec: only async-signal-safe calls. Reports
// a failure as its errno on `report` (close-on-exec, so an exec that works
// closes it with nothing written) and exits 127.
[[noreturn]] void ExecChild(char* const* argv, const Subprocess::Options& options, int stdout_fd,
                            pid_t parent, int report) {
  // A test that crashes (no destructor runs) must not leave its children
  // running: they would hold CTest's output pipe until the test's timeout.
  // The signal comes when the thread that forked exits: Start() from the main
  // thread (Options::die_with_parent says more).
  if (options.die_with_parent) {
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) ChildFailed(report);
    if (::getppid() != parent) ::_exit(127);  // the parent died before the prctl
  }
  if (options.quiet) {
    const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null_fd < 0 || ::dup2(null_fd, 2) < 0 || ::dup2(null_fd, 1) < 0) ChildFailed(report);
  }
  if (stdout_fd >= 0 && ::dup2(stdout_fd, 1) < 0) ChildFailed(report);  // dup2 clears close-on-exec
  if (options.file_size_limit > 0) {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGXFSZ);
    if (::sigprocmask(SIG_BLOCK, &mask, nullptr) != 0) ChildFailed(report);
  }
  ::execve(argv[0], argv, environ);
  ChildFailed(report);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const std::vector<std::string>& argv,
                                                              const Options& options) {
  if (argv.empty()) return absl::InvalidArgumentError("Subprocess::Start: empty argv");
  std::vector<std::string> args = argv;
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  arg_ptrs.push_back(nullptr);

  int out[2] = {-1, -1};
  if (options.pipe_stdout && ::pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  int report[2] = {-1, -1};
  if (::pipe2(report, O_CLOEXEC) != 0) {
    const int e = errno;
    if (out[0] >= 0) ::close(out[0]), ::close(out[1]);
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(e)));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) ExecChild(arg_ptrs.data(), options, out[1], parent, report[1]);
  const int fork_errno = errno;
  ::close(report[1]);
  if (out[1] >= 0) ::close(out[1]);
  int child_errno = 0;
  ssize_t got = 0;
  if (pid > 0) {
    do {
      got = ::read(report[0], &child_errno, sizeof(child_errno));
    } while (got < 0 && errno == EINTR);
  }
  ::close(report[0]);
  if (pid < 0 || got > 0) {
    if (out[0] >= 0) ::close(out[0]);
    if (pid > 0) {
      while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
    return absl::InternalError(absl::StrCat(pid < 0 ? "fork for " : "exec ", args[0], ": ",
                                            std::strerror(pid < 0 ? fork_errno : child_errno)));
  }
  std::unique_ptr<Subprocess> process(new Subprocess(pid, out[0]));
  if (options.file_size_limit > 0) {
    const struct rlimit limit = {options.file_size_limit, options.file_size_limit};
    if (::prlimit(pid, RLIMIT_FSIZE, &limit, nullptr) != 0) {
      return absl::InternalError(
          absl::StrCat("prlimit RLIMIT_FSIZE of ", args[0], ": ", std::strerror(errno)));
    }
  }
  return process;
}

Subprocess::~Subprocess() {
  if (pid_ >= 0) Kill();
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
}

bool Subprocess::alive() {
  if (pid_ < 0) return false;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) == pid_) {
    wait_status_ = status;
    pid_ = -1;
    return false;
  }
  return true;
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (alive()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return *wait_status_;
}

absl::StatusOr<int> Subprocess::Signal(int signal, absl::Duration timeout) {
  if (pid_ >= 0) ::kill(pid_, signal);
  return Wait(timeout);
}

int Subprocess::Kill() {
  if (pid_ >= 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    wait_status_ = status;
    pid_ = -1;
  }
  return *wait_status_;
}

int ExitCode(int wait_status) {
  return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 128 + WTERMSIG(wait_status);
}

}  // namespace qtx::testing

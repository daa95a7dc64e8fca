#include "tests/testing/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
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

// posix_spawn's attributes and file actions, destroyed on scope exit.
class SpawnSetup {
 public:
  SpawnSetup() {
    posix_spawnattr_init(&attr);
    posix_spawn_file_actions_init(&actions);
  }
  ~SpawnSetup() {
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
  }
  SpawnSetup(const SpawnSetup&) = delete;
  SpawnSetup& operator=(const SpawnSetup&) = delete;

  posix_spawnattr_t attr;
  posix_spawn_file_actions_t actions;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const std::vector<std::string>& argv,
                                                              const Options& options) {
  if (argv.empty()) return absl::InvalidArgumentError("Subprocess::Start: empty argv");
  std::vector<std::string> args = argv;
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  arg_ptrs.push_back(nullptr);

  SpawnSetup setup;
  if (options.quiet) {
    posix_spawn_file_actions_addopen(&setup.actions, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&setup.actions, 2, "/dev/null", O_WRONLY, 0);
  }
  int out[2] = {-1, -1};
  if (options.pipe_stdout) {
    if (::pipe2(out, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
    }
    // dup2 clears close-on-exec on the child's fd 1; both pipe ends close at the exec.
    posix_spawn_file_actions_adddup2(&setup.actions, out[1], 1);
  }
  if (options.file_size_limit > 0) {
    sigset_t mask;
    pthread_sigmask(SIG_BLOCK, nullptr, &mask);
    sigaddset(&mask, SIGXFSZ);
    posix_spawnattr_setsigmask(&setup.attr, &mask);
    posix_spawnattr_setflags(&setup.attr, POSIX_SPAWN_SETSIGMASK);
  }
  pid_t pid = -1;
  const int rc =
      posix_spawn(&pid, args[0].c_str(), &setup.actions, &setup.attr, arg_ptrs.data(), environ);
  if (out[1] >= 0) ::close(out[1]);
  if (rc != 0) {
    if (out[0] >= 0) ::close(out[0]);
    return absl::InternalError(absl::StrCat("posix_spawn ", args[0], ": ", std::strerror(rc)));
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

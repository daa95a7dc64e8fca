// Subprocess: one child process (fork and exec of an executable with its arguments), the one place
// where tests start processes: qtxd (through QtxdProcess), the qtx CLI, or the test binary itself
// in a child mode. The destructor kills (SIGKILL) and reaps a child that is still running.
// One owner thread.
#ifndef QTX_TESTS_TESTING_SUBPROCESS_H_
#define QTX_TESTS_TESTING_SUBPROCESS_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace qtx::testing {

class Subprocess {
 public:
  struct Options {
    // The child's stdout and stderr go to /dev/null.
    bool quiet = false;
    // The child's stdout goes to a pipe whose read end is stdout_fd() (its stderr stays the
    // test's). Overrides `quiet` for stdout.
    bool pipe_stdout = false;
    // > 0: the child's RLIMIT_FSIZE in bytes (set right after the exec, with prlimit), with
    // SIGXFSZ blocked in the child, so that a write past the limit fails with EFBIG instead of
    // killing the process.
    rlim_t file_size_limit = 0;
    // The child is killed (SIGKILL) when the thread that started it exits,
    // the test process included, however it ends (Linux's parent-death
    // signal): a crashed test leaves no qtxd behind. Turn it off to start a
    // child from a thread that ends before the child should.
    bool die_with_parent = true;
  };

  // Starts argv[0] (a path) with the arguments argv[1...] and the test's environment. Fails with
  // INVALID_ARGUMENT for an empty argv, INTERNAL with the fork or exec error (e.g. no such file).
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const std::vector<std::string>& argv,
                                                           const Options& options);
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const std::vector<std::string>& argv) {
    return Start(argv, Options());
  }

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  // The child's process id; -1 once it has been reaped.
  pid_t pid() const { return pid_; }
  // The read end of the child's stdout (Options::pipe_stdout), owned by this object; else -1.
  int stdout_fd() const { return stdout_fd_; }

  // True while the child runs: not reaped, and not exited (an exited child is reaped here).
  bool alive();

  // Waits up to `timeout` for the child to exit and returns its wait status (as from waitpid:
  // use WIFEXITED, WEXITSTATUS, ...; the same status again once reaped). DEADLINE_EXCEEDED while
  // it still runs after `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // Sends `signal` (unless the child was reaped already) and then waits as Wait does.
  absl::StatusOr<int> Signal(int signal, absl::Duration timeout);
  // kill -9: SIGKILL, then reaps the child; its wait status.
  int Kill();

 private:
  Subprocess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}

  pid_t pid_;                       // -1 once reaped
  int stdout_fd_;                   // -1 without Options::pipe_stdout
  std::optional<int> wait_status_;  // set when reaped
};

// A wait status as a shell reports it: the exit status, or 128 + the signal that killed it.
int ExitCode(int wait_status);

}  // namespace qtx::testing

#endif  // QTX_TESTS_TESTING_SUBPROCESS_H_

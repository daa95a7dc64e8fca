// QtxdProcess: a qtxd child process on a private unix socket, for end-to-end
// tests and benchmarks (the one qtxd launcher of tests/ and bench/). Start() spawns it and waits
// until its health service says SERVING; the destructor sends SIGTERM and reaps it (SIGKILL after a
// grace period).
// One owner thread.
#ifndef QTX_TESTS_TESTING_QTXD_PROCESS_H_
#define QTX_TESTS_TESTING_QTXD_PROCESS_H_

#include <sys/types.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "qtx/client.h"

namespace qtx::testing {

class QtxdProcess {
 public:
  // Starts `qtxd_path --socket=<tmpdir>/qtxd.sock <extra_args...>` and waits
  // up to `timeout` for SERVING, asking over the socket with `probe` options
  // (e.g. the auth token of a token-protected qtxd). Fails with the spawn
  // error or DEADLINE_EXCEEDED (the child is killed then).
  static absl::StatusOr<std::unique_ptr<QtxdProcess>> Start(
      const std::string& qtxd_path, const std::vector<std::string>& extra_args,
      absl::Duration timeout = absl::Seconds(30), const ClientOptions& probe = {});

  // The temporary directory holding the socket (removed with the process).
  const std::string& dir() const { return dir_; }

  QtxdProcess(const QtxdProcess&) = delete;
  QtxdProcess& operator=(const QtxdProcess&) = delete;
  ~QtxdProcess();

  // "unix://<socket path>".
  std::string target() const { return "unix://" + socket_path_; }
  const std::string& socket_path() const { return socket_path_; }
  // The child's process id (e.g. to read its CPU time); -1 once reaped.
  pid_t pid() const { return pid_; }

  // Sends SIGTERM and waits up to `grace` for exit. Returns the exit status
  // (as from waitpid's WEXITSTATUS; 128+signal when killed by a signal).
  absl::StatusOr<int> Stop(absl::Duration grace = absl::Seconds(20));

 private:
  QtxdProcess(pid_t pid, std::string dir, std::string socket_path)
      : pid_(pid), dir_(std::move(dir)), socket_path_(std::move(socket_path)) {}

  pid_t pid_;  // -1 once reaped
  const std::string dir_;
  const std::string socket_path_;
};

// The --qtxd=PATH argument of a test binary that starts qtxd (call it after
// ::testing::InitGoogleTest, which takes gtest's own flags out of argv).
// Without it, prints a usage line naming the binary and exits with status 2.
std::string QtxdFlagOrExit(int argc, char** argv);

// The qtxd binary of a test target compiled with QTXD_PATH: $QTXD when set
// (e.g. a qtxd from a bundle on a GPU host), else QTXD_PATH.
#ifdef QTXD_PATH
inline std::string QtxdPath() {
  const char* env = std::getenv("QTXD");
  return env != nullptr && *env != '\0' ? env : QTXD_PATH;
}
#endif

}  // namespace qtx::testing

#endif  // QTX_TESTS_TESTING_QTXD_PROCESS_H_

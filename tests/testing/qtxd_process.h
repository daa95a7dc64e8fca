// QtxdProcess: a qtxd child process on a private unix socket, for end-to-end
// tests and benchmarks (the one qtxd launcher of tests/ and bench/; it starts
// the process through Subprocess). Start() spawns it and waits until its health
// service says SERVING; the destructor sends SIGTERM and reaps it (SIGKILL
// after a grace period).
// One owner thread.
#ifndef QTX_TESTS_TESTING_QTXD_PROCESS_H_
#define QTX_TESTS_TESTING_QTXD_PROCESS_H_

#include <signal.h>
#include <sys/types.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "qtx/client.h"
#include "tests/testing/subprocess.h"

namespace qtx::testing {

class QtxdProcess {
 public:
  struct Options {
    // How long to wait for SERVING.
    absl::Duration timeout = absl::Seconds(30);
    // Client options of the SERVING probe (e.g. the auth token of a
    // token-protected qtxd).
    ClientOptions probe;
    // How the child is started (quiet, file size limit).
    Subprocess::Options process;
  };

  // Starts `qtxd_path --socket=<tmpdir>/qtxd.sock --log_level=warn
  // <extra_args...>` (the level is $QTX_TEST_QTXD_LOG_LEVEL when set) and waits up to
  // `options.timeout` for SERVING, asking over the socket. Fails with the spawn error, INTERNAL
  // when qtxd exits during startup, or DEADLINE_EXCEEDED (the child is killed then).
  static absl::StatusOr<std::unique_ptr<QtxdProcess>> Start(
      const std::string& qtxd_path, const std::vector<std::string>& extra_args,
      const Options& options);
  // The same with a `timeout` and `probe` options and the default Subprocess options.
  static absl::StatusOr<std::unique_ptr<QtxdProcess>> Start(
      const std::string& qtxd_path, const std::vector<std::string>& extra_args,
      absl::Duration timeout = absl::Seconds(30), const ClientOptions& probe = {});

  // Start() with --listen_tcp=127.0.0.1:<port> added, on a port that
  // FreeLoopbackPort() found free; when qtxd cannot start there (another test
  // took the port in between), tries another port, up to 4 ports in all.
  // `*port` is the port of the qtxd returned.
  static absl::StatusOr<std::unique_ptr<QtxdProcess>> StartOnLoopbackPort(
      const std::string& qtxd_path, const std::vector<std::string>& extra_args,
      const Options& options, int* port);

  // The temporary directory holding the socket (removed with the process).
  const std::string& dir() const { return dir_; }

  QtxdProcess(const QtxdProcess&) = delete;
  QtxdProcess& operator=(const QtxdProcess&) = delete;
  ~QtxdProcess();

  // "unix://<socket path>".
  std::string target() const { return "unix://" + socket_path_; }
  const std::string& socket_path() const { return socket_path_; }
  // The child's process id (e.g. to read its CPU time); -1 once reaped.
  pid_t pid() const { return process_->pid(); }
  // True while qtxd runs (not stopped, killed or exited).
  bool alive() { return process_->alive(); }

  // Sends `signal` (SIGTERM or SIGINT: a clean shutdown) and waits up to
  // `grace` for exit. Returns the exit status (as from waitpid's WEXITSTATUS;
  // 128+signal when killed by a signal); DEADLINE_EXCEEDED when qtxd ignored
  // the signal for `grace` (it is killed then); FAILED_PRECONDITION when it was
  // stopped already.
  absl::StatusOr<int> Stop(absl::Duration grace = absl::Seconds(20), int signal = SIGTERM);
  // kill -9: SIGKILL and reap, no shutdown (no shutdown checkpoint, the socket
  // file stays). Does nothing once stopped.
  void Kill() { process_->Kill(); }

 private:
  QtxdProcess(std::unique_ptr<Subprocess> process, std::string dir, std::string socket_path)
      : process_(std::move(process)), dir_(std::move(dir)), socket_path_(std::move(socket_path)) {}

  const std::unique_ptr<Subprocess> process_;
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

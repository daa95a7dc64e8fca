// qtxd: the qtx sidecar. Parses flags, starts a QtxServer, and waits for
// SIGTERM/SIGINT (taken synchronously with sigwait: no async signal handler
// runs), then stops accepting, lets in-flight calls finish, removes the
// socket and exits 0.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/api/server.h"
#include "server/config/flags.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  // Several requests run at once, each with its own OpenMP team for the CPU
  // kernels; libgomp's default lets idle team threads spin after every
  // parallel region, stealing the cores from the other requests and the gRPC
  // threads. PASSIVE lets them sleep (bench/load_bench, 16 clients, 16 cores:
  // +11% calls/s, -11% CPU per call; see bench/README.md). libgomp reads the
  // variable when it is loaded, before main, so set it and exec ourselves once;
  // a value the user set is kept.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    ::execv("/proc/self/exe", argv);  // returns only on failure: run as we are
  }
  // Stream-ordered channels park a stream of ours in cuStreamWaitValue64 until
  // the client's GPU reaches the operation. With CUDA's default lazy module
  // loading, the first launch of a kernel not yet loaded waits for the
  // context, i.e. for that parked stream: a deadlock until the client moves.
  // Load every kernel when the context is created. Read at CUDA's first call,
  // which comes later; a different value set by the user is overridden (it
  // would hang channels), and said so in the log below.
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  const std::string user_loading = loading == nullptr ? "" : loading;
  ::setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  qtx::server::config::InstallFlagsUsageConfig();  // --help lists qtxd's flags
  absl::SetProgramUsageMessage(
      "qtxd: gRPC sidecar for block-scaled FP8 quantization (qtx.v1).\n"
      "Example: qtxd --socket=/tmp/qtxd.sock --allow_client_shm");
  absl::ParseCommandLine(argc, argv);
  // Debian's Abseil is built without NDEBUG, so every absl::Mutex lock runs
  // the debug deadlock detector (a global graph update); gRPC locks through
  // absl::Mutex too, dozens of times per call. 37 -> 11 ns per uncontended
  // lock on the CI host; tests keep the detector (they do not run main).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  if (!user_loading.empty() && user_loading != "EAGER") {
    spdlog::warn(
        "event=cuda_module_loading_overridden was={} now=EAGER (channels need kernels "
        "loaded before a stream waits)",
        user_loading);
  }

  const std::string level = qtx::server::config::LogLevelFromFlags();
  const spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    std::fprintf(stderr, "qtxd: --log_level=%s: must be trace, debug, info, warn, error or off\n",
                 level.c_str());
    return 2;
  }
  spdlog::set_level(lvl);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%fZ %l qtxd %v", spdlog::pattern_time_type::utc);

  // Block the shutdown signals in every thread (the ones gRPC and the
  // executor start inherit this mask); this thread takes them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client that disconnects mid-write must not kill the server.
  signal(SIGPIPE, SIG_IGN);
  // Every registered shm region keeps its descriptor open (its size is
  // checked on each use), up to RegionTableOptions::max_regions of them:
  // raise the soft limit on open files to the hard one.
  struct rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &files) != 0) {
      spdlog::warn("event=rlimit_nofile_unchanged soft={}", static_cast<uint64_t>(files.rlim_cur));
    }
  }

  const qtx::server::config::ServerConfig config = qtx::server::config::ServerConfigFromFlags();
  auto server = qtx::server::api::QtxServer::Create(config);
  if (!server.ok()) {
    spdlog::critical("event=startup_failed code={} msg=\"{}\"",
                     absl::StatusCodeToString(server.status().code()),
                     std::string(server.status().message()));
    return 1;
  }

  int sig = 0;
  while (sigwait(&signals, &sig) != 0) {
  }
  spdlog::info("event=signal signal={}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  if (!(*server)->Shutdown(absl::Seconds(config.shutdown_grace_s))) {
    // Some call never finished (a wedged worker): destroying the server would
    // wait for it forever. The state it does not hold was checkpointed.
    spdlog::critical(
        "event=shutdown_incomplete exit=1 (calls still running after "
        "--shutdown_grace_s plus 5 s were abandoned)");
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    ::_exit(1);
  }
  server->reset();
  return 0;
}

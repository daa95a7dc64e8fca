#include "tests/testing/qtxd_process.h"

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
#include "tests/testing/free_port.h"

namespace qtx::testing {

absl::StatusOr<std::unique_ptr<QtxdProcess>> QtxdProcess::Start(
    const std::string& qtxd_path, const std::vector<std::string>& extra_args,
    absl::Duration timeout, const ClientOptions& probe) {
  Options options;
  options.timeout = timeout;
  options.probe = probe;
  return Start(qtxd_path, extra_args, options);
}

absl::StatusOr<std::unique_ptr<QtxdProcess>> QtxdProcess::Start(
    const std::string& qtxd_path, const std::vector<std::string>& extra_args,
    const Options& options) {
  char dir_template[] = "/tmp/qtx-e2e-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  const std::string dir = dir_template;
  const std::string socket_path = dir + "/qtxd.sock";
  // QTX_TEST_QTXD_LOG_LEVEL (e.g. "info") makes the children log more, for
  // a failure seen only on another machine.
  const char* level = std::getenv("QTX_TEST_QTXD_LOG_LEVEL");
  std::vector<std::string> args = {
      qtxd_path, "--socket=" + socket_path,
      absl::StrCat("--log_level=", level != nullptr && *level != '\0' ? level : "warn")};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Start(args, options.process);
  if (!child.ok()) {
    std::filesystem::remove_all(dir);
    return child.status();
  }
  std::unique_ptr<QtxdProcess> process(new QtxdProcess(*std::move(child), dir, socket_path));
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(process->target(), options.probe);
  if (!client.ok()) return client.status();
  const absl::Time deadline = absl::Now() + options.timeout;
  absl::Status last;
  while (absl::Now() < deadline) {
    if (!process->alive()) {
      return absl::InternalError(absl::StrCat("qtxd exited during startup with status ",
                                              ExitCode(process->process_->Kill())));
    }
    last = (*client)->WaitUntilServing(absl::Milliseconds(200));
    if (last.ok()) return process;
  }
  process->Kill();
  return absl::DeadlineExceededError(absl::StrCat(
      "qtxd not serving after ", absl::FormatDuration(options.timeout), ": ", last.ToString()));
}

absl::StatusOr<std::unique_ptr<QtxdProcess>> QtxdProcess::StartOnLoopbackPort(
    const std::string& qtxd_path, const std::vector<std::string>& extra_args,
    const Options& options, int* port) {
  absl::Status last;
  for (int attempt = 0; attempt < 4; ++attempt) {
    *port = FreeLoopbackPort();
    std::vector<std::string> args = extra_args;
    args.push_back(absl::StrCat("--listen_tcp=127.0.0.1:", *port));
    absl::StatusOr<std::unique_ptr<QtxdProcess>> process = Start(qtxd_path, args, options);
    if (process.ok()) return process;
    last = process.status();
    // Only an exit during startup (e.g. "cannot bind") is worth another port.
    if (last.code() != absl::StatusCode::kInternal) break;
  }
  return absl::Status(last.code(),
                      absl::StrCat("on a loopback port (the last ", *port, "): ", last.message()));
}

absl::StatusOr<int> QtxdProcess::Stop(absl::Duration grace, int signal) {
  if (process_->pid() < 0) return absl::FailedPreconditionError("qtxd already stopped");
  absl::StatusOr<int> status = process_->Signal(signal, grace);
  if (!status.ok()) {
    process_->Kill();
    return absl::DeadlineExceededError(absl::StrCat("qtxd ignored signal ", signal, " for ",
                                                    absl::FormatDuration(grace), "; killed"));
  }
  return ExitCode(*status);
}

QtxdProcess::~QtxdProcess() {
  if (process_->pid() >= 0) Stop().IgnoreError();
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

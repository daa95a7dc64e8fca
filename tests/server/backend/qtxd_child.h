// QtxdChild: qtxd as a child process for the GPU end-to-end tests;
// SIGTERM (then SIGKILL after 5 s) on destruction. The caller waits for it to
// serve. One owner thread. QtxdPath(): $QTXD, else the QTXD_PATH the test
// target is compiled with.
#ifndef QTX_TESTS_SERVER_BACKEND_QTXD_CHILD_H_
#define QTX_TESTS_SERVER_BACKEND_QTXD_CHILD_H_

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace qtx::testing {

class QtxdChild {
 public:
  // `args[0]` is the qtxd binary.
  explicit QtxdChild(const std::vector<std::string>& args) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0) pid_ = -1;
  }
  ~QtxdChild() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  QtxdChild(const QtxdChild&) = delete;
  QtxdChild& operator=(const QtxdChild&) = delete;

  bool started() const { return pid_ > 0; }

 private:
  pid_t pid_ = -1;
};

#ifdef QTXD_PATH
inline std::string QtxdPath() {
  const char* env = std::getenv("QTXD");
  return env != nullptr && *env != '\0' ? env : QTXD_PATH;
}
#endif

}  // namespace qtx::testing

#endif  // QTX_TESTS_SERVER_BACKEND_QTXD_CHILD_H_

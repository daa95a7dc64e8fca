// CreateUniqueShm: a new POSIX shm object under a name no other object has,
// for tests that need a client's shm. A name made of the pid alone is not
// enough: a test process that dies without unlinking its objects (a death
// test's child, a killed run) leaves them in /dev/shm, and pids come round
// again (pid_max is 32768 in a container), so a later process would find its
// name taken. The name carries a random part too, and a taken name is skipped.
#ifndef QTX_TESTS_TESTING_UNIQUE_SHM_H_
#define QTX_TESTS_TESTING_UNIQUE_SHM_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>

namespace qtx::testing {

// Creates (O_CREAT | O_EXCL, mode 0600) "/<prefix>-<pid>-<random>" and
// returns its fd, with the name in *name; on failure returns -1 with errno set
// (never EEXIST: a taken name is retried under another, up to 16 times).
inline int CreateUniqueShm(std::string_view prefix, std::string* name) {
  std::random_device seed;
  std::mt19937_64 rng((static_cast<uint64_t>(seed()) << 32) ^ seed());
  for (int attempt = 0; attempt < 16; ++attempt) {
    char suffix[40];
    std::snprintf(suffix, sizeof(suffix), "-%d-%016" PRIx64, static_cast<int>(::getpid()),
                  static_cast<uint64_t>(rng()));
    *name = "/" + std::string(prefix) + suffix;
    const int fd = ::shm_open(name->c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

}  // namespace qtx::testing

#endif  // QTX_TESTS_TESTING_UNIQUE_SHM_H_

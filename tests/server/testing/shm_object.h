// Test helper: a POSIX shm object created (and unlinked) by the test, mapped
// read-write on the client side. One test thread at a time.
#ifndef QTX_TESTS_SERVER_TESTING_SHM_OBJECT_H_
#define QTX_TESTS_SERVER_TESTING_SHM_OBJECT_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "tests/testing/unique_shm.h"

namespace qtx::testing {

class ShmObject {
 public:
  // Creates a fresh object of `size` bytes (zero-filled); check ok(), and
  // error() says why not.
  explicit ShmObject(size_t size) : size_(size) {
    const int fd = CreateUniqueShm("qtx-server-test", &name_);
    if (fd < 0) {
      error_ = "shm_open(" + name_ + "): " + std::strerror(errno);
      return;
    }
    if (size == 0) {
      error_ = "a shm object of 0 bytes cannot be mapped";
    } else if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      error_ = "ftruncate(" + name_ + "): " + std::strerror(errno);
    } else {
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        data_ = static_cast<std::byte*>(p);
      } else {
        error_ = "mmap(" + name_ + "): " + std::strerror(errno);
      }
    }
    ::close(fd);
  }
  ~ShmObject() {
    if (data_ != nullptr) ::munmap(data_, size_);
    ::shm_unlink(name_.c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  bool ok() const { return data_ != nullptr; }
  const std::string& error() const { return error_; }
  const std::string& name() const { return name_; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::string name_;
  std::string error_;
  size_t size_;
  std::byte* data_ = nullptr;
};

}  // namespace qtx::testing

#endif  // QTX_TESTS_SERVER_TESTING_SHM_OBJECT_H_

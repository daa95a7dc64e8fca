// Test helper: a POSIX shm object created (and unlinked) by the test, mapped
// read-write on the client side. One test thread at a time.
#ifndef QTX_TESTS_SERVER_TESTING_SHM_OBJECT_H_
#define QTX_TESTS_SERVER_TESTING_SHM_OBJECT_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace qtx::testing {

class ShmObject {
 public:
  // Creates a fresh object of `size` bytes (zero-filled); check ok().
  explicit ShmObject(size_t size) : size_(size) {
    static std::atomic<int> counter{0};
    name_ = "/qtx-server-test-" + std::to_string(::getpid()) + "-" +
            std::to_string(counter.fetch_add(1));
    const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return;
    if (::ftruncate(fd, static_cast<off_t>(size)) == 0 && size > 0) {
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) data_ = static_cast<std::byte*>(p);
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
  const std::string& name() const { return name_; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::string name_;
  size_t size_;
  std::byte* data_ = nullptr;
};

}  // namespace qtx::testing

#endif  // QTX_TESTS_SERVER_TESTING_SHM_OBJECT_H_

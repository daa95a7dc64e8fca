// A client that truncates a registered shm object while qtxd uses it must not
// kill qtxd: the SIGBUS is absorbed, the region reports DATA_LOSS and refuses
// later pins. A SIGBUS anywhere else still kills the process.
#include "server/tensor/shm_fault_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tensor/region_table.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::tensor {
namespace {

using ::qtx::testing::ShmObject;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

RegionTableOptions ShmAllowed() {
  RegionTableOptions o;
  o.allow_client_shm = true;
  return o;
}

bool Truncate(const std::string& shm_name, off_t size) {
  const int fd = ::shm_open(shm_name.c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  const bool ok = ::ftruncate(fd, size) == 0;
  ::close(fd);
  return ok;
}

// Reads every byte through a volatile pointer (the compiler may not skip it).
uint64_t Sum(const std::byte* p, size_t n) {
  const volatile std::byte* v = p;
  uint64_t s = 0;
  for (size_t i = 0; i < n; i += 64) s += static_cast<uint64_t>(v[i]);
  return s;
}

TEST(ShmFaultGuard, TruncatedUnderAPinReadsZerosAndReportsDataLoss) {
  constexpr size_t kBytes = 16 * 4096;
  ShmObject shm(kBytes);
  ASSERT_TRUE(shm.ok()) << shm.error();
  std::memset(shm.data(), 1, kBytes);
  RegionTable table(ShmAllowed());
  QTX_ASSERT_OK(table.RegisterShm("r", shm.name(), 0, kBytes));
  QTX_ASSERT_OK_AND_ASSIGN(auto pin, table.Acquire("r"));
  QTX_EXPECT_OK(pin->Intact());
  const uint64_t faults_before = ShmFaultGuard::faults_total();

  ASSERT_TRUE(Truncate(shm.name(), 4 * 4096));
  // Without the guard the read past the new end raises SIGBUS and kills the
  // test. The first 4 pages are still the object's; the rest read as zeros.
  EXPECT_EQ(Sum(pin->data(), kBytes), 4u * 4096 / 64);
  pin->data()[kBytes - 1] = std::byte{7};  // writes do not fault either
  EXPECT_GT(ShmFaultGuard::faults_total(), faults_before);
  EXPECT_THAT(pin->Intact(), StatusIs(absl::StatusCode::kDataLoss,
                                      HasSubstr("was truncated while this request used it")));
  EXPECT_THAT(CheckIntact(pin), StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
  QTX_EXPECT_OK(CheckIntact(nullptr));

  // Even with its size back, the region's mapping is no longer the object:
  // pins are refused until it is registered again.
  ASSERT_TRUE(Truncate(shm.name(), kBytes));
  EXPECT_THAT(table.Acquire("r"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("register it again")));
  pin.reset();
  QTX_ASSERT_OK(table.Unregister("r"));
  QTX_ASSERT_OK(table.RegisterShm("r", shm.name(), 0, kBytes));
  QTX_ASSERT_OK_AND_ASSIGN(auto fresh, table.Acquire("r"));
  QTX_EXPECT_OK(fresh->Intact());
  shm.data()[5 * 4096] = std::byte{9};  // the new mapping shows the object again
  EXPECT_EQ(fresh->data()[5 * 4096], std::byte{9});
}

// Many threads (as an OpenMP kernel would) touch the region while it shrinks
// to nothing: none of them dies.
TEST(ShmFaultGuard, ConcurrentReadersSurviveATruncation) {
  constexpr size_t kBytes = 256 * 4096;
  for (int round = 0; round < 20; ++round) {
    ShmObject shm(kBytes);
    ASSERT_TRUE(shm.ok()) << shm.error();
    std::memset(shm.data(), 3, kBytes);
    RegionTable table(ShmAllowed());
    QTX_ASSERT_OK(table.RegisterShm("r", shm.name(), 0, kBytes));
    QTX_ASSERT_OK_AND_ASSIGN(auto pin, table.Acquire("r"));
    std::atomic<bool> stop{false};
    std::atomic<int64_t> passes[4] = {};
    std::vector<std::thread> readers;
    for (int t = 0; t < 4; ++t) {
      readers.emplace_back([&, t] {
        while (!stop.load()) {
          (void)Sum(pin->data(), kBytes);
          passes[t].fetch_add(1);
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200 * round));
    ASSERT_TRUE(Truncate(shm.name(), (round % 4) * 4096));
    // Stop only once every reader has finished a whole pass begun after the
    // truncation (two more passes than it had then): each of them has then
    // run into the truncated pages, however the threads were scheduled.
    int64_t at_truncation[4];
    for (int t = 0; t < 4; ++t) at_truncation[t] = passes[t].load();
    for (int t = 0; t < 4; ++t) {
      while (passes[t].load() < at_truncation[t] + 2) std::this_thread::yield();
    }
    stop.store(true);
    for (auto& r : readers) r.join();
    EXPECT_THAT(pin->Intact(), StatusIs(absl::StatusCode::kDataLoss, ::testing::_))
        << "round " << round;
  }
}

// Killed by SIGBUS, or (under a sanitizer, whose SIGBUS handler was there
// first and gets the fault forwarded) exited with the sanitizer's error code.
bool DiedOfTheFault(int status) {
  return (WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) ||
         (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

// The guard only absorbs faults in watched ranges: a SIGBUS in any other
// mapping still kills the process, as it would without the guard.
TEST(ShmFaultGuardDeathTest, FaultOutsideRegisteredRegionsStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok()) << shm.error();
  RegionTable table(ShmAllowed());
  QTX_ASSERT_OK(table.RegisterShm("r", shm.name(), 0, 4096));  // the guard is installed
  EXPECT_EXIT(
      {
        ShmObject other(2 * 4096);
        const int fd = ::shm_open(other.name().c_str(), O_RDWR, 0);
        void* p = ::mmap(nullptr, 2 * 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        ::ftruncate(fd, 0);
        // This process dies without running destructors: unlink its objects
        // (this one and the child's own `shm`) first, so none outlives it.
        ::shm_unlink(other.name().c_str());
        ::shm_unlink(shm.name().c_str());
        (void)Sum(static_cast<std::byte*>(p) + 4096, 4096);
        std::exit(0);  // not reached
      },
      DiedOfTheFault, "");
}

}  // namespace
}  // namespace qtx::server::tensor

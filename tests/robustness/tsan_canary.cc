// Canary for the TSan step of scripts/hardening.sh: proves the TSan setup
// (instrumentation, tests/testing/tsan_absl_shim.cc, tests/robustness/tsan.supp,
// TSAN_OPTIONS) is neither blind nor crying wolf.
//   tsan_canary <mode>
// Racy modes must be reported by TSan (the step fails if TSan stays silent):
//   unlocked      two threads write one int, no lock
//   two_mutexes   each thread holds its own absl::Mutex (no common lock)
//   after_notify  the writer writes again after Notify()
// Clean modes must run without a report (the step fails on one):
//   mutex         absl::MutexLock around both writes
//   await         hand-off through Mutex::Await(Condition) and AwaitWithDeadline
//   lock_when     hand-off through Mutex::LockWhen(Condition)
//   condvar       hand-off through absl::CondVar::Wait
//   notification  hand-off through Notify / WaitForNotification
// Each mode prints "tsan_canary: <mode> ran to the end" and returns 0 when its
// threads ran to the end (TSan's exit code, 66 by default, tells that it
// reported); an unknown mode returns 2. A run without that line did not run
// the mode at all (e.g. the TSan runtime refused the address-space layout:
// scripts/hardening.sh starts TSan binaries with ASLR off for that reason).
//
// Determinism: in every racy mode both threads are alive, and have met, before
// either makes its racy access, and neither ends before the other made it.
// TSan (the LLVM 14+ runtime) keeps one vector-clock slot per live thread; a
// thread that starts after another ended may take over its slot and with it
// the ended thread's epoch, which hides their race. And the two racy accesses
// happen one after the other in real time: the second thread waits for a flag
// the first sets after its access. Released together, the two threads made
// their accesses at the same instant, and each checked the shadow memory
// before the other had written it: clang 14's runtime then missed the race of
// `unlocked` in 78 of 100 runs on a 2-core machine (session 18), and CI failed.
// The meeting and the flag go through relaxed atomics, which TSan does not
// count as synchronization.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace {

// Written by both threads; `volatile` only so the compiler keeps each store.
volatile int shared_value = 0;

void Write(int v) { shared_value = shared_value + v; }

// Both threads arrive here before either goes on (relaxed: no happens-before).
class Meet {
 public:
  void Arrive() {
    arrived_.fetch_add(1, std::memory_order_relaxed);
    while (arrived_.load(std::memory_order_relaxed) < 2) std::this_thread::yield();
  }

 private:
  std::atomic<int> arrived_{0};
};

template <typename A, typename B>
void RunPair(A a, B b) {
  std::thread t1(a);
  std::thread t2(b);
  t1.join();
  t2.join();
}

// A flag set after one thread's access and awaited before the other's
// (relaxed: it orders the accesses in time, not for TSan).
class Turn {
 public:
  void Pass() { passed_.store(true, std::memory_order_relaxed); }
  void Await() {
    while (!passed_.load(std::memory_order_relaxed)) std::this_thread::yield();
  }

 private:
  std::atomic<bool> passed_{false};
};

// Runs the racy pair: each thread meets the other; `a` makes its access, then
// `b` makes its own; each meets the other again before it ends.
template <typename A, typename B>
void RunRacyPair(A a, B b) {
  Meet before, after;
  Turn turn;
  RunPair(
      [&] {
        before.Arrive();
        a();
        turn.Pass();
        after.Arrive();
      },
      [&] {
        before.Arrive();
        turn.Await();
        b();
        after.Arrive();
      });
}

int Unlocked() {
  RunRacyPair([] { Write(1); }, [] { Write(2); });
  return 0;
}

int TwoMutexes() {
  absl::Mutex mu1, mu2;
  RunRacyPair(
      [&] {
        absl::MutexLock l(&mu1);
        Write(1);
      },
      [&] {
        absl::MutexLock l(&mu2);
        Write(2);
      });
  return 0;
}

int AfterNotify() {
  absl::Notification n;
  Meet before, after;  // both alive around the unordered writes
  Turn turn;           // Write(3), then Write(2)
  RunPair(
      [&] {
        Write(1);
        n.Notify();
        before.Arrive();
        Write(3);  // not covered by the notification
        turn.Pass();
        after.Arrive();
      },
      [&] {
        n.WaitForNotification();
        before.Arrive();
        turn.Await();
        Write(2);
        after.Arrive();
      });
  return 0;
}

int Guarded() {
  absl::Mutex mu;
  RunPair(
      [&] {
        for (int i = 0; i < 1000; ++i) {
          absl::MutexLock l(&mu);
          Write(1);
        }
      },
      [&] {
        for (int i = 0; i < 1000; ++i) {
          absl::MutexLock l(&mu);
          Write(2);
        }
      });
  return 0;
}

// Producer writes the value, then flips `ready` under the lock; the consumer
// waits for it (Await, then AwaitWithDeadline for a second round) and writes.
int Await() {
  absl::Mutex mu;
  int round = 0;  // guarded by mu
  RunPair(
      [&] {
        Write(1);
        {
          absl::MutexLock l(&mu);
          round = 1;
          mu.Await(absl::Condition(
              +[](int* r) { return *r == 2; }, &round));
        }
        Write(3);
        absl::MutexLock l(&mu);
        round = 3;
      },
      [&] {
        {
          absl::MutexLock l(&mu);
          mu.Await(absl::Condition(
              +[](int* r) { return *r == 1; }, &round));
        }
        Write(2);
        absl::MutexLock l(&mu);
        round = 2;
        while (!mu.AwaitWithDeadline(absl::Condition(
                                         +[](int* r) { return *r == 3; }, &round),
                                     absl::Now() + absl::Seconds(1))) {
        }
      });
  return 0;
}

int LockWhen() {
  absl::Mutex mu;
  bool ready = false;  // guarded by mu
  RunPair(
      [&] {
        Write(1);
        absl::MutexLock l(&mu);
        ready = true;
      },
      [&] {
        mu.LockWhen(absl::Condition(&ready));
        mu.Unlock();
        Write(2);
      });
  return 0;
}

int CondVar() {
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false;  // guarded by mu
  RunPair(
      [&] {
        Write(1);
        absl::MutexLock l(&mu);
        ready = true;
        cv.Signal();
      },
      [&] {
        {
          absl::MutexLock l(&mu);
          while (!ready) cv.Wait(&mu);
        }
        Write(2);
      });
  return 0;
}

int Notification() {
  absl::Notification n;
  RunPair(
      [&] {
        Write(1);
        n.Notify();
      },
      [&] {
        n.WaitForNotification();
        Write(2);
      });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  struct Mode {
    const char* name;
    int (*run)();
  };
  const Mode modes[] = {
      {"unlocked", Unlocked},
      {"two_mutexes", TwoMutexes},
      {"after_notify", AfterNotify},
      {"mutex", Guarded},
      {"await", Await},
      {"lock_when", LockWhen},
      {"condvar", CondVar},
      {"notification", Notification},
  };
  if (argc == 2) {
    for (const Mode& m : modes) {
      if (std::strcmp(argv[1], m.name) == 0) {
        const int rc = m.run();
        std::fprintf(stderr, "tsan_canary: %s ran to the end\n", m.name);
        return rc;
      }
    }
  }
  std::fprintf(stderr, "usage: tsan_canary <mode>; modes:");
  for (const Mode& m : modes) std::fprintf(stderr, " %s", m.name);
  std::fprintf(stderr, "\n");
  return 2;
}

// QtxdRanks: `world` qtxd processes with one client each, the set-up of the
// multi-process tests (collectives, sharded optimizer state, parameter
// gathers), the Gloo Collective group they form, and the per-call deadline
// their calls carry. Rank r's client talks to rank r's qtxd; rank 0's qtxd
// coordinates the group.
// One owner thread; OnEveryRank runs one thread per rank.
#ifndef QTX_TESTS_TESTING_QTXD_RANKS_H_
#define QTX_TESTS_TESTING_QTXD_RANKS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "qtx/client.h"
#include "tests/testing/qtxd_process.h"

namespace qtx::testing {

struct QtxdRanks {
  std::vector<std::unique_ptr<QtxdProcess>> servers;
  std::vector<std::unique_ptr<Client>> clients;
  int world() const { return static_cast<int>(clients.size()); }
};

// Starts `world` qtxd from `qtxd_path`, rank r with the arguments flags(r),
// and connects a client to each. Fails naming the rank that did not start.
absl::Status StartQtxdRanks(const std::string& qtxd_path, int world,
                            const std::function<std::vector<std::string>(int rank)>& flags,
                            QtxdRanks* ranks);

// CallOptions with only the timeout set: a collective call that waits for its
// peers fails DEADLINE_EXCEEDED after `timeout` instead of hanging a test.
CallOptions Deadline(absl::Duration timeout);

// Runs fn(rank) on one thread per rank and waits for all of them.
void OnEveryRank(int world, const std::function<void(int rank)>& fn);

// CreateGroup `name` over Gloo on ranks 0..world-1 at once (every rank when
// world < 0; rank 0 coordinates; `timeout` is the group's timeout, the call
// gets ten seconds more). One result per rank.
std::vector<absl::StatusOr<CollectiveGroupInfo>> CreateGlooGroupOnEveryRank(const QtxdRanks& ranks,
                                                                            const std::string& name,
                                                                            absl::Duration timeout,
                                                                            int world = -1);

}  // namespace qtx::testing

#endif  // QTX_TESTS_TESTING_QTXD_RANKS_H_

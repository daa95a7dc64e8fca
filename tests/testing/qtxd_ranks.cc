#include "tests/testing/qtxd_ranks.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace qtx::testing {

absl::Status StartQtxdRanks(const std::string& qtxd_path, int world,
                            const std::function<std::vector<std::string>(int rank)>& flags,
                            QtxdRanks* ranks) {
  for (int r = 0; r < world; ++r) {
    absl::StatusOr<std::unique_ptr<QtxdProcess>> server = QtxdProcess::Start(qtxd_path, flags(r));
    if (!server.ok()) {
      return absl::Status(server.status().code(),
                          absl::StrCat("rank ", r, ": ", server.status().message()));
    }
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect((*server)->target());
    if (!client.ok()) {
      return absl::Status(client.status().code(),
                          absl::StrCat("rank ", r, ": ", client.status().message()));
    }
    ranks->servers.push_back(*std::move(server));
    ranks->clients.push_back(*std::move(client));
  }
  return absl::OkStatus();
}

CallOptions Deadline(absl::Duration timeout) {
  CallOptions call;
  call.timeout = timeout;
  return call;
}

void OnEveryRank(int world, const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

std::vector<absl::StatusOr<CollectiveGroupInfo>> CreateGlooGroupOnEveryRank(const QtxdRanks& ranks,
                                                                            const std::string& name,
                                                                            absl::Duration timeout,
                                                                            int world) {
  if (world < 0) world = ranks.world();
  std::vector<absl::StatusOr<CollectiveGroupInfo>> infos(
      world, absl::UnknownError("CreateGroup did not run"));
  OnEveryRank(world, [&](int r) {
    CollectiveGroupConfig config;
    config.name = name;
    config.rank = r;
    config.world_size = world;
    config.coordinator = r == 0 ? "" : ranks.servers[0]->target();
    config.backend = CommBackend::kGloo;
    config.timeout = timeout;
    CallOptions call;
    call.timeout = timeout + absl::Seconds(10);
    infos[r] = ranks.clients[r]->CreateGroup(config, call);
  });
  return infos;
}

}  // namespace qtx::testing

// Uses the installed qtx::client: layout math, an shm region, and a call to a
// server that is not there (must fail with UNAVAILABLE, not crash).
#include <cstdio>
#include <vector>

#include "qtx/client.h"
#include "qtx/shm_region.h"

int main() {
  auto layout =
      qtx::ComputeQuantizedLayout(qtx::ScalingMode::kBlock1D, std::vector<int64_t>{200, 300});
  if (!layout.ok() || layout->rowwise_scale_rows != 3 || layout->rowwise_scale_cols != 200) {
    std::fprintf(stderr, "bad layout\n");
    return 1;
  }
  auto region = qtx::ShmRegion::Create("consumer", 4096);
  if (!region.ok()) {
    std::fprintf(stderr, "%s\n", region.status().ToString().c_str());
    return 1;
  }
  auto client = qtx::Client::Connect("unix:///nonexistent/qtx-consumer.sock");
  if (!client.ok()) return 1;
  auto health = (*client)->Health();
  if (health.ok() || health.status().code() != absl::StatusCode::kUnavailable) {
    std::fprintf(stderr, "expected UNAVAILABLE, got %s\n", health.status().ToString().c_str());
    return 1;
  }
  qtx::CollectiveGroupConfig group{.name = "g", .backend = qtx::CommBackend::kGloo};
  auto created = (*client)->CreateGroup(group);
  if (created.ok() || created.status().code() != absl::StatusCode::kUnavailable) {
    std::fprintf(stderr, "CreateGroup: expected UNAVAILABLE, got %s\n",
                 created.status().ToString().c_str());
    return 1;
  }
  std::printf("consumer ok\n");
  return 0;
}

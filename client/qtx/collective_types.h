// Plain C++ value types of the qtx client's Collective calls
// (Client::CreateGroup, AllGather, DestroyGroup, ListGroups). They mirror
// proto/qtx/v1/collective.proto without exposing protobuf: a group of
// sidecars, one per rank, that all-gathers block-scaled FP8 tensors
// bit-identically to quantizing the concatenation of the shards.
//
// All types are regular values, like those of qtx/types.h.
#ifndef QTX_CLIENT_QTX_COLLECTIVE_TYPES_H_
#define QTX_CLIENT_QTX_COLLECTIVE_TYPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "qtx/optimizer_types.h"
#include "qtx/types.h"

namespace qtx {

// How the sidecars of a group talk to each other. The numeric values equal
// qtx.v1.CommBackend.
enum class CommBackend : int32_t {
  kUnspecified = 0,  // the server picks: NCCL on a CUDA device, else Gloo
  kGloo = 1,         // CPU tensors over TCP
  kNccl = 2,         // GPU tensors (qtxd --device=cuda:N)
};

// How AllGather produces the gathered tensor; both give the same bytes. The
// numeric values equal qtx.v1.AllGatherMode.
enum class AllGatherMode : int32_t {
  // Exchange the partial amaxes of blocks that straddle ranks, quantize
  // locally, gather FP8 data + scales (1 byte per element on the wire).
  kExactFp8 = 1,
  // Gather the high-precision shards, then quantize (the reference path).
  kGatherHighPrecision = 2,
};

// The numeric values equal qtx.v1.GroupState.
enum class GroupState : int32_t {
  kUnspecified = 0,  // still joining
  kReady = 1,
  kBroken = 2,  // a collective failed (peer missing or dead): destroy and recreate
};

// "unspecified" / "gloo" / "nccl"; "unknown" for other values.
const char* CommBackendName(CommBackend backend);
// "exact_fp8" / "gather_high_precision"; "unknown" for other values.
const char* AllGatherModeName(AllGatherMode mode);
// "unspecified" / "ready" / "broken"; "unknown" for other values.
const char* GroupStateName(GroupState state);

// What Client::CreateGroup asks for. Every rank creates the group on its own
// sidecar with the same name and world_size.
struct CollectiveGroupConfig {
  std::string name{};  // unique per sidecar; the same on every rank
  int32_t rank = 0;    // 0 .. world_size-1
  int32_t world_size = 1;
  // gRPC target of rank 0's sidecar, as that sidecar is reachable from this
  // rank's sidecar ("host:port" or "unix:/path"). Rank 0's sidecar hosts the
  // rendezvous; rank 0 may leave it empty.
  std::string coordinator{};
  CommBackend backend = CommBackend::kUnspecified;
  // How long the sidecar waits for every rank to join, and the default
  // deadline of the group's collectives. Zero: the server default (60 s).
  // Sent in whole milliseconds (rounded up); must be >= 0 and below 2^32 ms.
  absl::Duration timeout = absl::ZeroDuration();
};

// A group as the server describes it.
struct CollectiveGroupInfo {
  std::string name;
  int32_t rank = 0;
  int32_t world_size = 0;
  CommBackend backend = CommBackend::kUnspecified;  // as resolved by the server
  GroupState state = GroupState::kUnspecified;
  uint64_t next_sequence = 0;  // the sequence number the next AllGather must carry
  std::string error;           // why the group is broken
};

// What Client::AllGather returns on every rank.
struct AllGatherResult {
  QuantizedTensor tensor;           // the quantized [sum M_r, N] tensor
  std::vector<int64_t> shard_rows;  // M_r of every rank, in rank order
};

// What Client::AllGatherParameter returns on every rank.
struct ParameterAllGatherResult {
  // The whole parameter's rowwise copy: data [M, N], scale_inv
  // [ceil(M/128), pad4(ceil(N/128))], byte-identical to quantizing the whole
  // parameter with BLOCK_2D; config.columnwise false.
  QuantizedTensor tensor;
  std::vector<ShardRange> ranges;  // every rank's range, in rank order
};

}  // namespace qtx

#endif  // QTX_CLIENT_QTX_COLLECTIVE_TYPES_H_

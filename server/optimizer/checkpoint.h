// Optimizer checkpoints: one file per group, "<dir>/<group>.qtxopt".
//
// "<dir>/<group>.qtxopt.prev" is the checkpoint it replaced (see
// WriteCheckpoint), for an explicit fallback when the newest is corrupted.
//
// Format (little-endian), version 1, 2 or 3:
//   "QTXOPTCK" | u32 version | u32 0 | u64 meta_bytes | u64 data_bytes |
//   meta (group config, counters, last step result, parameter table) |
//   data (per parameter: master FP32, exp_avg, exp_avg_sq) |
//   u32 CRC-32 (zlib) of every byte before it.
// Version 2 adds to each parameter table entry its own settings (u8 flags:
// bit 0 weight_decay set, bit 1 lr_scale set | f64 weight_decay | f64
// lr_scale). Version 3 adds after them the parameter's data-parallel shard
// range (u8 has_shard | i64 begin | i64 end); its data then holds the owned
// elements only. A group is written in the oldest version that holds it (1
// without per-parameter settings or ranges, which qtxd builds before version
// 2 read too); every version is read. A sharded group's checkpoint holds this
// sidecar's slices: it loads back at the same ranges (the same DP size).
// Writes are atomic: a temp file in the same directory is written, fsync-ed,
// renamed over the old checkpoint, and the directory is fsync-ed; a crash
// leaves either the old or the new checkpoint, never a torn one.
// Reads verify size, version and checksum before the state is used.
//
// Thread safety: functions are reentrant; concurrent writers of one group's
// file must be serialized by the caller (the store holds the group's lock).
#ifndef QTX_SERVER_OPTIMIZER_CHECKPOINT_H_
#define QTX_SERVER_OPTIMIZER_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/optimizer/group_state.h"

namespace qtx::server::optimizer {

inline constexpr std::string_view kCheckpointSuffix = ".qtxopt";
inline constexpr uint32_t kCheckpointVersion = 3;  // the newest version read and written

inline constexpr std::string_view kPreviousSuffix = ".prev";

std::string CheckpointPath(const std::string& dir, std::string_view group);
// The checkpoint before the newest: CheckpointPath(dir, group) + ".prev".
std::string PreviousCheckpointPath(const std::string& dir, std::string_view group);

// Writes `state` to CheckpointPath(dir, group) atomically; returns the file
// size. With `keep_previous`, the checkpoint it replaces is kept as
// PreviousCheckpointPath (hard link, made before the rename, so the newest
// path never goes missing); without, the old .prev stays as it is.
// RESOURCE_EXHAUSTED when the disk, quota or file-size limit is full, INTERNAL
// on any other I/O failure (both naming the path and errno text); the newest
// checkpoint is then untouched.
absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir, const GroupState& state,
                                         bool keep_previous = true);

// Reads and verifies a checkpoint. `reserve(bytes)` is called with the state's
// host bytes before any state buffer is allocated; its error is returned.
// NOT_FOUND: no file; DATA_LOSS: truncated, bad magic, inconsistent sizes or
// checksum mismatch; FAILED_PRECONDITION: unsupported version; INTERNAL: I/O.
absl::StatusOr<GroupState> ReadCheckpoint(
    const std::string& path, const std::function<absl::Status(uint64_t bytes)>& reserve);

// Resharding (docs/numerics.md §10.1): builds group `name`'s state at new
// data-parallel ranges from `sources`, the checkpoints every old owner wrote
// (any data-parallel size, sharded or not). `shards` maps a parameter name to
// this sidecar's new range of it; parameters it does not name are loaded
// whole. Each source is read once from start to end (its checksum verified);
// only the elements of the new ranges are kept. The loaded state has the
// sources' step, counters, last step result, configuration and parameter
// table, with the new ranges.
// INVALID_ARGUMENT: no source, a source named twice, sources that are not
//   checkpoints of one group (configuration, hyper-parameters, parameter
//   names, shapes or settings differ: the message names both files and the
//   field), parameters whose elements are in no source or in two sources
//   (naming the parameter, the elements and the files), a `shards` entry for
//   a parameter the sources do not hold, a bad new range (ValidateShards);
// FAILED_PRECONDITION: sources written at different steps (or with different
//   step results); ReadCheckpoint's errors for each source (NOT_FOUND,
//   DATA_LOSS, ...); `reserve`'s error.
absl::StatusOr<GroupState> ReadResharded(
    std::span<const std::string> sources, const std::string& name,
    const std::vector<std::pair<std::string, kernels::ElementRange>>& shards,
    const std::function<absl::Status(uint64_t bytes)>& reserve);

// Group names with a checkpoint in `dir`; removes stale temp files left by a
// crash. INTERNAL if the directory cannot be read.
absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& dir);

}  // namespace qtx::server::optimizer

#endif  // QTX_SERVER_OPTIMIZER_CHECKPOINT_H_

// qtx::Client: a synchronous C++ client for one qtxd sidecar.
//
//   auto client = qtx::Client::Connect("unix:///run/qtx/qtxd.sock");
//   if (!client.ok()) return client.status();
//   auto q = (*client)->Quantize(qtx::Tensor::FromFloat32({m, n}, values), {});
//
// Every call blocks until the server answers or the call's deadline passes and
// returns absl::Status / absl::StatusOr. Server errors keep their gRPC code and
// message (the codes are the same numbers as absl::StatusCode); a server that
// cannot be reached gives UNAVAILABLE, a missed deadline DEADLINE_EXCEEDED.
// Each call sends an "x-request-id" metadata entry (CallOptions::request_id, or
// a generated id) that the server logs with the request.
//
// A Client is safe for concurrent use by many threads; the underlying gRPC
// channel multiplexes the calls. It owns its channel; no protobuf or gRPC type
// appears in this header.
#ifndef QTX_CLIENT_QTX_CLIENT_H_
#define QTX_CLIENT_QTX_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "qtx/collective_types.h"
#include "qtx/optimizer_types.h"
#include "qtx/types.h"

namespace qtx {

class ShmRegion;

// The default qtxd socket, as a gRPC target.
inline constexpr std::string_view kDefaultTarget = "unix:///tmp/qtxd.sock";

struct ClientOptions {
  // Deadline of each call, unless CallOptions::timeout overrides it.
  // absl::InfiniteDuration() means no deadline.
  absl::Duration timeout = absl::Seconds(60);
  // Largest message sent or received, in bytes. Inline tensors need large
  // messages; the default is the protobuf limit (2 GiB - 1).
  int max_message_bytes = 0x7FFFFFFF;
  // > 0: Connect() waits up to this long for the channel to become ready and
  // fails with UNAVAILABLE otherwise. 0: Connect() returns at once and the
  // first call connects.
  absl::Duration connect_timeout = absl::ZeroDuration();
  // Wait for the server to become reachable (within the deadline) instead of
  // failing a call at once with UNAVAILABLE.
  bool wait_for_ready = false;

  // Bearer token sent as "authorization: Bearer <token>" on every call, for a
  // qtxd started with --auth_token_file. Empty: none. Without it such a
  // server answers UNAUTHENTICATED.
  std::string auth_token;

  // TLS for a "host:port" target whose qtxd listens with --tls_cert_file.
  // Off: plaintext (unix sockets and loopback TCP).
  bool tls = false;
  // PEM roots that sign the server certificate; empty = the system roots.
  std::string tls_root_certs_pem;
  // Client certificate chain and key (PEM) for a server that requires client
  // certificates (--tls_client_ca_file); both or neither.
  std::string tls_client_cert_pem;
  std::string tls_client_key_pem;
  // Name checked against the server certificate instead of the target's
  // host; empty = the host.
  std::string tls_server_name;
};

struct CallOptions {
  // Overrides ClientOptions::timeout for this call.
  std::optional<absl::Duration> timeout;
  // Sent as "x-request-id"; generated ("<client id>-<counter>") when empty.
  std::string request_id;
  // Interprocess CUDA event handles (64-byte cudaIpcEventHandle_t, e.g. from
  // qtx::cuda::IpcEvent in qtx_client_cuda) for Quantize, Dequantize,
  // Step and AllGather against a CUDA sidecar; empty = none; ignored by the
  // other calls.
  // cuda_wait_event: the sidecar's stream waits on it before touching the
  // tensors. cuda_signal_event: recorded after the outputs are written, and
  // the call returns once the work is enqueued -- wait on the event (e.g.
  // cudaStreamWaitEvent) before reading region outputs.
  std::string cuda_wait_event;
  std::string cuda_signal_event;
};

// grpc.health.v1 serving status.
enum class ServingStatus : int32_t {
  kUnknown = 0,
  kServing = 1,
  kNotServing = 2,
  kServiceUnknown = 3,
};
const char* ServingStatusName(ServingStatus status);  // "SERVING", ...

class Client {
 public:
  // Creates a client for `target`: "unix:///abs/path", "unix:path", an
  // absolute socket path ("/run/qtxd.sock", taken as unix://), or "host:port"
  // (plaintext; TLS comes with the TCP listener).
  // Fails with INVALID_ARGUMENT for an empty target or bad options (e.g. TLS
  // on a unix socket, a client certificate without its key, a token with
  // line breaks), and with
  // UNAVAILABLE when options.connect_timeout > 0 and the channel does not
  // become ready in time.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(std::string_view target,
                                                         const ClientOptions& options = {});

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client();

  // The gRPC target this client talks to (after normalization).
  const std::string& target() const;

  // Asks the grpc.health.v1 service for `service` ("" = the whole server).
  // Returns the serving status; NOT_FOUND from the server becomes
  // kServiceUnknown. Fails with the RPC's status otherwise (UNAVAILABLE when
  // the server cannot be reached).
  absl::StatusOr<ServingStatus> Health(std::string_view service = "", const CallOptions& call = {});

  // Polls Health() (waiting for the connection, whatever
  // ClientOptions::wait_for_ready says) until the server reports SERVING.
  // Fails with DEADLINE_EXCEEDED (naming the last status seen) after `timeout`.
  absl::Status WaitUntilServing(absl::Duration timeout);

  // Quantizes `input` (FLOAT32, BFLOAT16 or FLOAT16, inline or in a region).
  // Outputs with a slice in `outputs` are written into that region slice and
  // returned as region tensors; the others are returned inline. Inline input
  // bytes are copied into the request.
  // Fails with the server's status: INVALID_ARGUMENT for a bad dtype, shape,
  // byte count or config; NOT_FOUND for an unknown region; ...
  absl::StatusOr<QuantizedTensor> Quantize(const Tensor& input, const QuantizeConfig& config,
                                           const QuantizeOutputs& outputs = {},
                                           const CallOptions& call = {});

  // Dequantizes `input` (its rowwise copy when present, else the columnwise
  // copy) to `output_dtype` (FLOAT32, BFLOAT16 or FLOAT16). With `output` set,
  // the result is written into that region slice and returned as a region
  // tensor; otherwise it is returned inline.
  absl::StatusOr<Tensor> Dequantize(const QuantizedTensor& input,
                                    DType output_dtype = DType::kFloat32,
                                    const std::optional<RegionSlice>& output = std::nullopt,
                                    const CallOptions& call = {});

  // Registers [offset, offset + byte_size) of the POSIX shm object `shm_name`
  // under `name`. Fails with ALREADY_EXISTS for a taken name, NOT_FOUND for a
  // missing shm object, INVALID_ARGUMENT for bad bounds or names, and
  // PERMISSION_DENIED / FAILED_PRECONDITION when the server does not allow
  // client shm (qtxd --allow_client_shm).
  absl::Status RegisterShmRegion(std::string_view name, std::string_view shm_name, uint64_t offset,
                                 uint64_t byte_size, const CallOptions& call = {});
  // Registers all of `region` under region.name().
  absl::Status RegisterShmRegion(const ShmRegion& region, const CallOptions& call = {});

  // Registers device memory exported with cudaIpcGetMemHandle under `name`:
  // `ipc_handle` is the 64-byte cudaIpcMemHandle_t, `device_id` the CUDA
  // ordinal the memory is on (as the server numbers devices), `byte_size`
  // the usable bytes from the exported pointer. The server opens the handle
  // once and checks byte_size against the real allocation. Fails with
  // INVALID_ARGUMENT for a handle that is not 64 bytes or cannot be opened, a
  // wrong device_id or a byte_size beyond the allocation; FAILED_PRECONDITION
  // when the server does not compute on a CUDA device; ALREADY_EXISTS for a
  // taken name. (qtx_client_cuda's qtx::cuda::RegisterDevicePointer makes the
  // handle from a pointer.)
  absl::Status RegisterCudaIpcRegion(std::string_view name, std::string_view ipc_handle,
                                     int32_t device_id, uint64_t byte_size,
                                     const CallOptions& call = {});
  // As above, naming the GPU by its 16-byte UUID (cudaDeviceProp::uuid)
  // instead of an ordinal, which differs between processes whose
  // CUDA_VISIBLE_DEVICES differ. NOT_FOUND when qtxd does not see that GPU.
  absl::Status RegisterCudaIpcRegionOnGpu(std::string_view name, std::string_view ipc_handle,
                                          std::string_view device_uuid, uint64_t byte_size,
                                          const CallOptions& call = {});

  // Registers device memory made of physical chunks (cuMemCreate handles)
  // whose POSIX file descriptors were sent over qtxd's fd socket
  // (qtx/fd_passing.h): `fd_tokens` name those batches in order, one
  // descriptor per chunk; `chunk_sizes` are the chunks' allocation sizes;
  // the region is [offset, offset + byte_size) of the chunks mapped one
  // after another. Fails with NOT_FOUND for an unknown, expired or already
  // claimed token, INVALID_ARGUMENT for counts or sizes that do not match
  // the descriptors, a descriptor that is not a CUDA memory handle or memory
  // on another GPU than `device_uuid`; FAILED_PRECONDITION when qtxd does
  // not compute on a CUDA device. (qtx_client_cuda's RegionCache and
  // RegisterDevicePointer do all of this from a pointer.)
  absl::Status RegisterCudaVmmRegion(std::string_view name,
                                     const std::vector<std::string>& fd_tokens,
                                     const std::vector<uint64_t>& chunk_sizes, uint64_t offset,
                                     uint64_t byte_size, std::string_view device_uuid,
                                     const CallOptions& call = {});

  // Removes the region `name` (requests already using it finish first).
  // Fails with NOT_FOUND for an unknown name.
  absl::Status UnregisterRegion(std::string_view name, const CallOptions& call = {});

  // The regions registered with the server, as it reports them.
  absl::StatusOr<std::vector<RegionInfo>> ListRegions(const CallOptions& call = {});

  // ---- Optimizer (qtx.v1.Optimizer; semantics in proto/qtx/v1/optimizer.proto) ----

  // Hands a parameter group (FP32/BF16 master weights, optional moments) to
  // the sidecar's host memory. Returns the group as the server holds it.
  // Fails with INVALID_ARGUMENT (bad name, shape, dtype, hyper-parameter;
  // naming the field), ALREADY_EXISTS (group exists and !config.replace),
  // RESOURCE_EXHAUSTED (over qtxd's --optimizer_memory_limit_mb, checked
  // before allocating), NOT_FOUND (unknown region).
  absl::StatusOr<OptimizerGroupInfo> OffloadOptimizerState(
      const OptimizerGroupConfig& config, const std::vector<OptimizerParameterInit>& parameters,
      const CallOptions& call = {});

  // Applies AdamW step `step` (the group's step + 1) with one gradient per
  // parameter and returns the updated parameters (FP8 per the group's output
  // config, into options.destinations or inline) and the step statistics.
  // `step` equal to the group's step retries the last step: the stored result
  // is returned (stats.replayed) and nothing is applied twice. Fails with
  // FAILED_PRECONDITION for any other step number (naming the group's step),
  // NOT_FOUND for an unknown group, INVALID_ARGUMENT for a missing, unknown or
  // mis-shaped gradient, DATA_LOSS for a group whose checkpoint was corrupted.
  absl::StatusOr<OptimizerStepResult> Step(std::string_view group, int64_t step,
                                           const std::vector<OptimizerGradient>& gradients,
                                           const StepOptions& options = {},
                                           const CallOptions& call = {});

  // The first phase of a two-phase step: this group's share (sum of squares,
  // non-finite flag) of the gradient norm of step `step` for `gradients`
  // (one per parameter, as for Step); nothing changes. Add sum_squares and
  // or non_finite over every group of every rank, then call Step with
  // options.clip_factor = ClipFactor(total, max_grad_norm) and options.skip
  // on every rank. `step` is the group's step + 1, or its step for a retry
  // of a processed step (step_processed; the Step then replays). Fails with
  // FAILED_PRECONDITION for any other step number (naming the group's step),
  // NOT_FOUND, INVALID_ARGUMENT as Step. With options.collective_group the
  // sidecars of that Collective group add the contributions among
  // themselves: every rank gets total_sum_squares / total_non_finite (a
  // collective call: FAILED_PRECONDITION for a used sequence or when the
  // ranks measured different steps; DEADLINE_EXCEEDED when a rank does not
  // take part in time).
  absl::StatusOr<GradNormResult> GradNorm(std::string_view group, int64_t step,
                                          const std::vector<OptimizerGradient>& gradients,
                                          const GradNormOptions& options = {},
                                          const CallOptions& call = {});

  // Fetches master weights (and with include_moments the moments), inline or
  // into options.destinations. NOT_FOUND for an unknown group or parameter;
  // RESOURCE_EXHAUSTED when the inline part exceeds the server's message
  // budget (give destinations or fewer names).
  absl::StatusOr<OptimizerState> GetState(std::string_view group,
                                          const GetStateOptions& options = {},
                                          const CallOptions& call = {});

  // Writes the checkpoint of `group` ("" = every usable group) in qtxd's
  // --checkpoint_dir. FAILED_PRECONDITION without a checkpoint directory;
  // INTERNAL on I/O errors (the previous checkpoint is then intact).
  absl::StatusOr<std::vector<CheckpointInfo>> SaveCheckpoint(std::string_view group = "",
                                                             const CallOptions& call = {});

  // Replaces the group's state with its checkpoint (creating the group);
  // with `previous`, with the checkpoint before the newest (the explicit
  // fallback when the newest is reported corrupted; qtxd never falls back on
  // its own). NOT_FOUND: no checkpoint; DATA_LOSS: corrupted, or a value no
  // request could set (a hand-edited file); FAILED_PRECONDITION: no
  // checkpoint directory, an unsupported version, or not a regular file.
  absl::StatusOr<OptimizerGroupInfo> LoadCheckpoint(std::string_view group, bool previous = false,
                                                    const CallOptions& call = {});

  // Resharding: loads `group` at this sidecar's new data-parallel ranges
  // from `sources`, every old owner's checkpoint file of the group (absolute
  // paths this qtxd may read: under its --checkpoint_dir or
  // --checkpoint_import_dirs), written at any data-parallel size. `shards`:
  // the new range of each parameter this sidecar takes a range of (empty
  // ranges for parameters it owns nothing of); parameters not named are
  // loaded whole. Call it on every new owner with the same sources, then
  // SaveCheckpoint on each (the loaded state is in memory only).
  // INVALID_ARGUMENT: sources of different groups, elements in no source or
  // in two, a bad range; FAILED_PRECONDITION: sources at different steps;
  // PERMISSION_DENIED: a source outside the allowed directories; NOT_FOUND /
  // DATA_LOSS: a missing or corrupted source. See LoadCheckpointRequest in
  // proto/qtx/v1/optimizer.proto.
  absl::StatusOr<OptimizerGroupInfo> LoadResharded(std::string_view group,
                                                   const std::vector<std::string>& sources,
                                                   const std::vector<ParameterShard>& shards,
                                                   const CallOptions& call = {});

  // Frees the group's host memory and deletes its checkpoints (a restarted
  // qtxd does not bring it back). NOT_FOUND if absent.
  absl::Status ReleaseGroup(std::string_view group, const CallOptions& call = {});

  // Every optimizer group (failed ones carry `error`) and the memory cap.
  absl::StatusOr<OptimizerGroupList> ListOptimizerGroups(const CallOptions& call = {});

  // ---- Collective (qtx.v1.Collective; semantics in proto/qtx/v1/collective.proto) ----
  //
  // A group has one sidecar per rank; every rank calls its own sidecar
  // through its own Client. CreateGroup and AllGather are collective: each
  // returns once every rank of the group has made the matching call (or
  // fails on every rank that made it).

  // Joins the group `config.name` as `config.rank`, waiting up to
  // config.timeout for every rank to join (keep the call's deadline longer).
  // Returns the group as this sidecar holds it (state kReady).
  // Fails with INVALID_ARGUMENT for a bad name, rank, world size, backend or
  // timeout, or an empty coordinator on a rank > 0 (naming the field);
  // ALREADY_EXISTS for a name in use on this sidecar; FAILED_PRECONDITION (or
  // UNIMPLEMENTED in a qtxd built without NCCL) for NCCL on a sidecar without
  // a CUDA device; DEADLINE_EXCEEDED when the other ranks do not join in time.
  absl::StatusOr<CollectiveGroupInfo> CreateGroup(const CollectiveGroupConfig& config,
                                                  const CallOptions& call = {});

  // All-gathers this rank's shard `input` ([M_r, N], or higher rank with the
  // leading dims flattened; FLOAT32, BFLOAT16 or FLOAT16, inline or in a
  // region; M_r may be 0 and need not be a multiple of 128) and returns the
  // quantized [sum M_r, N] tensor, byte-identical to Quantize of the
  // concatenation of the shards in rank order, with every rank's M_r.
  // `sequence` counts the group's AllGathers from 0; every rank passes the
  // same value. Outputs with a slice in `outputs` are written into that
  // region slice (sized for [sum M_r, N]); the others are returned inline.
  // CallOptions::cuda_wait_event / cuda_signal_event are sent as for
  // Quantize (CUDA sidecars; a CPU rank refuses them with
  // FAILED_PRECONDITION, and its peers fail too).
  // Fails with INVALID_ARGUMENT when the ranks disagree (N, dtype, config,
  // mode, ...: on every rank, naming the field and the ranks) or for a bad
  // input; FAILED_PRECONDITION for a sequence number already used or too far
  // ahead; NOT_FOUND for an unknown group or region; DEADLINE_EXCEEDED or
  // ABORTED when a peer is missing or dies (the group is then broken).
  // `shard_rows` (optional): every rank's M_r in rank order, the same list on
  // every rank; given, the sidecars move everything in one all-gather with
  // no exchange of shapes first (qtx.v1.AllGatherRequest.shard_rows). Either
  // every rank of a call passes it or none does.
  absl::StatusOr<AllGatherResult> AllGather(std::string_view group, uint64_t sequence,
                                            const Tensor& input, const QuantizeConfig& config,
                                            AllGatherMode mode = AllGatherMode::kExactFp8,
                                            const QuantizeOutputs& outputs = {},
                                            const CallOptions& call = {},
                                            const std::vector<int64_t>& shard_rows = {});

  // The FP8 parameter all-gather (qtx.v1.Collective.AllGatherParameter,
  // docs/numerics.md §10): `shard` is this rank's FP8 shard of a parameter
  // quantized with 128x128 blocks, e.g. OptimizerStepResult's
  // ParameterOutput::fp8 of a data-parallel sharded Step as is: shape the
  // whole parameter's, config BLOCK_2D, rowwise_data the end - begin bytes of
  // elements `range` of the flattened [M, N] rowwise data, rowwise_scale_inv
  // the whole parameter's scales (columnwise_scale_inv is not read;
  // columnwise_data must be absent). Returns, on every rank, the whole
  // rowwise copy, byte-identical to quantizing the whole parameter, and every
  // rank's range. Only the rowwise copy is gathered: make the columnwise one
  // from it where needed (qtx::cuda::MakeColumnwiseCopy). `sequence` is the
  // group's call counter, shared with AllGather and sharded Steps. Outputs
  // with a slice in `outputs` (rowwise only) are written there, in place
  // when this rank's shard already lies at its offset of that slice.
  // `name` (optional) names the parameter in messages.
  // Fails on every rank with INVALID_ARGUMENT when the ranks disagree on the
  // shape, config, scales (compared by digest) or sequence, or their ranges
  // do not cover the parameter exactly once (naming the field and the rank),
  // or with the error of a rank whose request was bad; DEADLINE_EXCEEDED or
  // ABORTED when a peer is missing or dies (the group is then broken).
  absl::StatusOr<ParameterAllGatherResult> AllGatherParameter(
      std::string_view group, uint64_t sequence, const QuantizedTensor& shard, ShardRange range,
      const QuantizeOutputs& outputs = {}, const CallOptions& call = {},
      std::string_view name = {});

  // Leaves and frees the group `name` on this sidecar. NOT_FOUND if absent.
  absl::Status DestroyGroup(std::string_view name, const CallOptions& call = {});

  // The collective groups this sidecar is a member of.
  absl::StatusOr<std::vector<CollectiveGroupInfo>> ListGroups(const CallOptions& call = {});

 private:
  friend class Channel;  // opens its stream on this client's gRPC channel
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);

  absl::StatusOr<ServingStatus> HealthImpl(std::string_view service, const CallOptions& call,
                                           bool wait_for_ready);

  // Constant after construction; Impl is itself safe for concurrent use.
  const std::unique_ptr<Impl> impl_;
};

}  // namespace qtx

#endif  // QTX_CLIENT_QTX_CLIENT_H_

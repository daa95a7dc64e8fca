// gRPC handler for qtx.v1.StreamChannel (proto/qtx/v1/channel.proto): one
// bidirectional stream is one ops::Channel. The reactor converts each
// submission to an op spec and hands it to the channel (which enqueues it on
// its own thread), and streams the channel's progress back, coalesced. It
// never blocks a reaction: the channel is closed on the Executor.
//
// Thread safety: used concurrently by gRPC; members are safe for concurrent
// use and outlive the grpc::Server.
#ifndef QTX_SERVER_API_CHANNEL_SERVICE_H_
#define QTX_SERVER_API_CHANNEL_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"
#include "qtx/v1/channel.grpc.pb.h"
#include "server/api/collective_service.h"
#include "server/api/executor.h"
#include "server/ops/op_context.h"

namespace qtx::server::api {

class StreamChannelService final : public v1::StreamChannel::CallbackService {
 public:
  // `ctx` members and `executor` are not owned and must outlive the service.
  // `close_grace`: how long a channel whose client closed its side waits for
  // the client's GPU to reach the submitted operations before it lets them
  // run regardless (a client that was cancelled or disconnected gets none).
  // `collective` runs channel AllGathers on their groups (null: refused).
  StreamChannelService(ops::OpContext ctx, Executor* executor, CollectiveService* collective,
                       absl::Duration close_grace = absl::Seconds(10))
      : ctx_(ctx), executor_(executor), collective_(collective), close_grace_(close_grace) {}

  grpc::ServerBidiReactor<v1::ChannelRequest, v1::ChannelReply>* Connect(
      grpc::CallbackServerContext* context) override;

  // Channels open now.
  int64_t open_channels() const { return open_.load(std::memory_order_relaxed); }

 private:
  friend class ChannelReactor;

  // Constant after construction.
  const ops::OpContext ctx_;
  Executor* const executor_;
  CollectiveService* const collective_;
  const absl::Duration close_grace_;

  std::atomic<uint64_t> next_id_{1};
  std::atomic<int64_t> open_{0};
};

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_CHANNEL_SERVICE_H_

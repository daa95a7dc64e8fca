#include "server/tensor/region_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
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

TEST(RegionTable, ShmRefusedWhenFlagOff) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionTable table{RegionTableOptions{}};
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 0, 4096),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--allow_client_shm")));
  EXPECT_EQ(table.size(), 0u);
}

TEST(RegionTable, RegisterMapsTheRequestedRangeAtAnUnalignedOffset) {
  ShmObject shm(3 * 4096);
  ASSERT_TRUE(shm.ok());
  for (size_t i = 0; i < shm.size(); ++i) shm.data()[i] = static_cast<std::byte>(i * 7);
  RegionTable table(ShmAllowed());
  QTX_ASSERT_OK(table.RegisterShm("acts:0", shm.name(), 4196, 5000));
  QTX_ASSERT_OK_AND_ASSIGN(auto pin, table.Acquire("acts:0"));
  EXPECT_EQ(pin->byte_size(), 5000u);
  EXPECT_EQ(pin->kind(), RegionKind::kShm);
  EXPECT_EQ(pin->memory_kind(), MemoryKind::kHost);
  EXPECT_EQ(std::memcmp(pin->data(), shm.data() + 4196, 5000), 0);
  // Writes through the server mapping are visible to the client.
  pin->data()[0] = std::byte{0xAB};
  EXPECT_EQ(shm.data()[4196], std::byte{0xAB});
}

// A client that truncates its shm object after registering it would make the
// server's next access fault (SIGBUS): the pin is refused instead, naming the
// sizes, and works again once the object has its size back.
TEST(RegionTable, ShmObjectShrunkAfterRegistrationIsRefusedAtPinTime) {
  ShmObject shm(3 * 4096);
  ASSERT_TRUE(shm.ok());
  RegionTable table(ShmAllowed());
  QTX_ASSERT_OK(table.RegisterShm("w", shm.name(), 4096, 8192));
  QTX_EXPECT_OK(table.Acquire("w").status());
  const int fd = ::shm_open(shm.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096 + 100), 0);
  EXPECT_THAT(table.Acquire("w").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shrank to 4196 bytes after registration, below the registered "
                                 "range's end 12288")));
  EXPECT_EQ(table.List()[0].in_use, 0u);  // the refused pin left no count behind
  ASSERT_EQ(::ftruncate(fd, 3 * 4096), 0);
  QTX_EXPECT_OK(table.Acquire("w").status());
  ::close(fd);
}

TEST(RegionTable, RangeBeyondTheObjectIsRejected) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionTable table(ShmAllowed());
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 0, 4097),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("offset 0 + shm.byte_size 4097 exceeds the size 4096")));
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 4096, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the size 4096")));
  QTX_EXPECT_OK(table.RegisterShm("r", shm.name(), 4095, 1));
}

TEST(RegionTable, OffsetPlusSizeOverflowIsRejected) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionTable table(ShmAllowed());
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_THAT(table.RegisterShm("r", shm.name(), max, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the size")));
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 8, max - 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the size")));
  EXPECT_EQ(table.size(), 0u);
}

TEST(RegionTable, ZeroSizeIsRejected) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionTable table(ShmAllowed());
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shm.byte_size=0")));
}

TEST(RegionTable, DuplicateNameIsRejected) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionTable table(ShmAllowed());
  QTX_ASSERT_OK(table.RegisterShm("r", shm.name(), 0, 4096));
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 0, 16),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("'r' is already registered")));
}

TEST(RegionTable, UnknownShmObjectIsNotFound) {
  RegionTable table(ShmAllowed());
  EXPECT_THAT(table.RegisterShm("r", "/qtx-no-such-object-xyz", 0, 16),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/qtx-no-such-object-xyz")));
}

TEST(RegionTable, BadNamesAreRejected) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionTable table(ShmAllowed());
  EXPECT_THAT(table.RegisterShm("", shm.name(), 0, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be 1..128")));
  EXPECT_THAT(table.RegisterShm(std::string(129, 'a'), shm.name(), 0, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("length 129")));
  EXPECT_THAT(table.RegisterShm("a b", shm.name(), 0, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("character 1")));
  EXPECT_THAT(table.RegisterShm("r", "no-slash", 0, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shm.shm_name='no-slash'")));
  EXPECT_THAT(table.RegisterShm("r", "/a/b", 0, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only the first")));
  EXPECT_THAT(table.RegisterShm("r", "/", 0, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shm.shm_name")));
}

TEST(RegionTable, UnknownNamesAreNotFound) {
  RegionTable table(ShmAllowed());
  EXPECT_THAT(table.Acquire("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope' is not registered")));
  EXPECT_THAT(table.Unregister("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope' is not registered")));
}

TEST(RegionTable, UnregisterWhilePinnedKeepsTheMappingUntilTheLastPinDrops) {
  ShmObject shm(8192);
  ASSERT_TRUE(shm.ok());
  RegionTable table(ShmAllowed());
  QTX_ASSERT_OK(table.RegisterShm("r", shm.name(), 0, 8192));
  QTX_ASSERT_OK_AND_ASSIGN(std::shared_ptr<const Region> pin, table.Acquire("r"));
  std::shared_ptr<const Region> pin2 = pin;  // a copy is the same pin
  EXPECT_EQ(table.List().at(0).in_use, 1u);

  QTX_ASSERT_OK(table.Unregister("r"));
  EXPECT_THAT(table.Acquire("r"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'r'")));
  EXPECT_TRUE(table.List().empty());
  // Still mapped: reads and writes work.
  pin->data()[8191] = std::byte{42};
  EXPECT_EQ(shm.data()[8191], std::byte{42});
  // The name may be reused at once.
  QTX_EXPECT_OK(table.RegisterShm("r", shm.name(), 0, 16));
  pin.reset();
  EXPECT_EQ(pin2->in_use(), 1u);
  pin2->data()[0] = std::byte{1};
  EXPECT_EQ(shm.data()[0], std::byte{1});
}

// A fake CUDA IPC opener lets the test observe exactly when memory is released.
struct FakeIpc {
  int opened = 0;
  int released = 0;
  std::byte buffer[256] = {};
};

RegionTableOptions WithFakeIpc(FakeIpc* ipc) {
  RegionTableOptions o;
  o.cuda_ipc_opener = [ipc](std::string_view handle, int32_t, uint64_t size)
      -> absl::StatusOr<MappedMemory> {
    if (handle.size() != kCudaIpcHandleBytes || size > sizeof(ipc->buffer)) {
      return absl::InternalError("fake opener misused");
    }
    ++ipc->opened;
    return MappedMemory{ipc->buffer, [ipc] { ++ipc->released; }};
  };
  return o;
}

TEST(RegionTable, MemoryIsReleasedByTheLastPinNotByUnregister) {
  FakeIpc ipc;
  RegionTable table(WithFakeIpc(&ipc));
  const std::string handle(64, 'h');
  QTX_ASSERT_OK(table.RegisterCudaIpc("dev", handle, 0, 128));
  EXPECT_EQ(ipc.opened, 1);
  QTX_ASSERT_OK_AND_ASSIGN(auto pin, table.Acquire("dev"));
  EXPECT_EQ(pin->memory_kind(), MemoryKind::kDevice);
  QTX_ASSERT_OK(table.Unregister("dev"));
  EXPECT_EQ(ipc.released, 0);
  pin.reset();
  EXPECT_EQ(ipc.released, 1);
  // Unregistering an unpinned region releases at once.
  QTX_ASSERT_OK(table.RegisterCudaIpc("dev", handle, 0, 128));
  QTX_ASSERT_OK(table.Unregister("dev"));
  EXPECT_EQ(ipc.released, 2);
}

TEST(RegionTable, CudaIpcByUuidOpensTheGpuTheResolverNames) {
  FakeIpc ipc;
  RegionTableOptions o = WithFakeIpc(&ipc);
  int32_t opened_on = -1;
  o.cuda_ipc_opener = [&ipc, &opened_on](std::string_view, int32_t device_id, uint64_t)
      -> absl::StatusOr<MappedMemory> {
    opened_on = device_id;
    return MappedMemory{ipc.buffer, [] {}};
  };
  const std::string uuid(16, '\x5a');
  o.cuda_uuid_resolver = [uuid](std::string_view u) -> absl::StatusOr<int32_t> {
    if (u == uuid) return 3;
    return absl::NotFoundError("no GPU with this UUID");
  };
  RegionTable table(o);
  // The ordinal the client sent (0) is ignored: the UUID decides.
  QTX_ASSERT_OK(table.RegisterCudaIpc("dev", std::string(64, 'h'), 0, 128, uuid));
  EXPECT_EQ(opened_on, 3);
  ASSERT_EQ(table.List().size(), 1u);
  EXPECT_EQ(table.List()[0].device_id, 3);
  EXPECT_THAT(table.RegisterCudaIpc("dev2", std::string(64, 'h'), 0, 128, std::string(16, 'x')),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no GPU with this UUID")));
  EXPECT_THAT(table.RegisterCudaIpc("dev3", std::string(64, 'h'), 0, 128, std::string(15, 'x')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("15 bytes, must be 16")));
  RegionTable no_cuda{RegionTableOptions{}};
  EXPECT_THAT(no_cuda.RegisterCudaIpc("dev", std::string(64, 'h'), 0, 128, uuid),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--device=cuda")));
}

TEST(RegionTable, CudaIpcValidatesBeforeRefusing) {
  RegionTable table{RegionTableOptions{}};
  EXPECT_THAT(table.RegisterCudaIpc("dev", std::string(63, 'h'), 0, 128),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("63 bytes, must be exactly 64")));
  EXPECT_THAT(table.RegisterCudaIpc("dev", std::string(64, 'h'), -1, 128),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_id=-1")));
  EXPECT_THAT(table.RegisterCudaIpc("dev", std::string(64, 'h'), 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte_size=0")));
  EXPECT_THAT(table.RegisterCudaIpc("dev", std::string(64, 'h'), 0, 128),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--device=cuda")));
}

TEST(RegionTable, ListIsSortedAndTooManyRegionsIsResourceExhausted) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionTableOptions o = ShmAllowed();
  o.max_regions = 2;
  RegionTable table(o);
  QTX_ASSERT_OK(table.RegisterShm("b", shm.name(), 0, 16));
  QTX_ASSERT_OK(table.RegisterShm("a", shm.name(), 16, 32));
  EXPECT_THAT(table.RegisterShm("c", shm.name(), 0, 16),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("maximum of 2")));
  auto list = table.List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].name, "a");
  EXPECT_EQ(list[0].byte_size, 32u);
  EXPECT_EQ(list[0].shm_name, shm.name());
  EXPECT_EQ(list[1].name, "b");
}

}  // namespace
}  // namespace qtx::server::tensor

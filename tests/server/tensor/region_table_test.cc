#include "server/tensor/region_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

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
  ASSERT_TRUE(shm.ok()) << shm.error();
  RegionTable table{RegionTableOptions{}};
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 0, 4096),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--allow_client_shm")));
  EXPECT_EQ(table.size(), 0u);
}

TEST(RegionTable, RegisterMapsTheRequestedRangeAtAnUnalignedOffset) {
  ShmObject shm(3 * 4096);
  ASSERT_TRUE(shm.ok()) << shm.error();
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
  ASSERT_TRUE(shm.ok()) << shm.error();
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
  ASSERT_TRUE(shm.ok()) << shm.error();
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
  ASSERT_TRUE(shm.ok()) << shm.error();
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
  ASSERT_TRUE(shm.ok()) << shm.error();
  RegionTable table(ShmAllowed());
  EXPECT_THAT(table.RegisterShm("r", shm.name(), 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shm.byte_size=0")));
}

TEST(RegionTable, DuplicateNameIsRejected) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok()) << shm.error();
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
  ASSERT_TRUE(shm.ok()) << shm.error();
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
  ASSERT_TRUE(shm.ok()) << shm.error();
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
  o.cuda_ipc_opener = [ipc](std::string_view handle, int32_t,
                            uint64_t size) -> absl::StatusOr<MappedMemory> {
    if (handle.size() != kCudaIpcHandleBytes || size > sizeof(ipc->buffer)) {
      return absl::InternalError("fake opener misused");
    }
    ++ipc->opened;
    return MappedMemory{ipc->buffer, [ipc] { ++ipc->released; }, {}, {}};
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
  o.cuda_ipc_opener = [&ipc, &opened_on](std::string_view, int32_t device_id,
                                         uint64_t) -> absl::StatusOr<MappedMemory> {
    opened_on = device_id;
    return MappedMemory{ipc.buffer, [] {}, {}, {}};
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
  EXPECT_THAT(
      table.RegisterCudaIpc("dev", std::string(63, 'h'), 0, 128),
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
  ASSERT_TRUE(shm.ok()) << shm.error();
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

// A fake VMM opener: records what it was asked to map.
struct FakeVmm {
  int opened = 0;
  int released = 0;
  std::vector<int> fds;
  std::vector<uint64_t> sizes;
  int32_t device = -1;
  uint64_t offset = 0;
  std::byte buffer[256] = {};
};

RegionTableOptions WithFakeVmm(FakeVmm* vmm) {
  RegionTableOptions o;
  o.cuda_vmm_opener = [vmm](std::span<const int> fds, std::span<const uint64_t> sizes,
                            int32_t device, uint64_t offset,
                            uint64_t) -> absl::StatusOr<MappedMemory> {
    ++vmm->opened;
    vmm->fds.assign(fds.begin(), fds.end());
    vmm->sizes.assign(sizes.begin(), sizes.end());
    vmm->device = device;
    vmm->offset = offset;
    return MappedMemory{vmm->buffer + offset, [vmm] { ++vmm->released; }, {}, {}};
  };
  o.cuda_uuid_resolver = [](std::string_view u) -> absl::StatusOr<int32_t> {
    if (u == std::string(16, 'g')) return 2;
    return absl::NotFoundError("no GPU with this UUID");
  };
  return o;
}

TEST(RegionTable, CudaVmmMapsTheChunksAndItsSessionDropsIt) {
  FakeVmm vmm;
  RegionTable table(WithFakeVmm(&vmm));
  const int fds[] = {11, 12, 13};
  const uint64_t sizes[] = {64, 64, 128};
  const std::string uuid(16, 'g');
  QTX_ASSERT_OK(table.RegisterCudaVmm("v1", fds, sizes, 16, 200, uuid, /*session=*/7));
  EXPECT_EQ(vmm.opened, 1);
  EXPECT_EQ(vmm.fds, std::vector<int>({11, 12, 13}));
  EXPECT_EQ(vmm.sizes, std::vector<uint64_t>({64, 64, 128}));
  EXPECT_EQ(vmm.device, 2);
  EXPECT_EQ(vmm.offset, 16u);
  QTX_ASSERT_OK(table.RegisterCudaVmm("v2", std::span<const int>(fds, 1),
                                      std::span<const uint64_t>(sizes, 1), 0, 64, uuid, 8));
  ASSERT_EQ(table.List().size(), 2u);
  EXPECT_EQ(table.List()[0].kind, RegionKind::kCudaVmm);
  EXPECT_EQ(table.List()[0].device_id, 2);
  QTX_ASSERT_OK_AND_ASSIGN(auto pin, table.Acquire("v1"));
  EXPECT_EQ(pin->memory_kind(), MemoryKind::kDevice);
  EXPECT_EQ(pin->data(), vmm.buffer + 16);
  // Session 7 ends: its region goes at once, its memory with the last pin.
  EXPECT_EQ(table.UnregisterSession(7), 1u);
  EXPECT_EQ(table.UnregisterSession(7), 0u);
  EXPECT_EQ(table.UnregisterSession(0), 0u);  // 0 is "no session": never matches
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(vmm.released, 0);
  pin.reset();
  EXPECT_EQ(vmm.released, 1);
  QTX_ASSERT_OK(table.Unregister("v2"));
  EXPECT_EQ(vmm.released, 2);
}

TEST(RegionTable, CudaVmmRejectsBadChunksWithoutOpening) {
  FakeVmm vmm;
  RegionTable table(WithFakeVmm(&vmm));
  const int fds[] = {3, 4};
  const uint64_t sizes[] = {64, 64};
  const uint64_t zero[] = {64, 0};
  const uint64_t huge[] = {UINT64_MAX, 2};
  const std::string uuid(16, 'g');
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, std::span<const uint64_t>(sizes, 1), 0, 64, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("1 chunks but the fd tokens carry 2 descriptors")));
  EXPECT_THAT(table.RegisterCudaVmm("v", {}, {}, 0, 64, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuda_vmm.chunks: empty")));
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, zero, 0, 64, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chunks[1].size=0")));
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, huge, 0, 64, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflow")));
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, sizes, 64, 65, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("offset 64 + byte_size 65 exceeds the 128 bytes")));
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, sizes, UINT64_MAX, 2, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds")));
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, sizes, 0, 0, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte_size=0")));
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, sizes, 0, 64, std::string(15, 'g'), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("15 bytes, must be 16")));
  EXPECT_THAT(table.RegisterCudaVmm("v", fds, sizes, 0, 64, std::string(16, 'x'), 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no GPU with this UUID")));
  EXPECT_THAT(table.RegisterCudaVmm("bad name!", fds, sizes, 0, 64, uuid, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name")));
  EXPECT_EQ(vmm.opened, 0);
  RegionTable no_cuda{RegionTableOptions{}};
  EXPECT_THAT(no_cuda.RegisterCudaVmm("v", fds, sizes, 0, 64, uuid, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--device=cuda")));
}

}  // namespace
}  // namespace qtx::server::tensor

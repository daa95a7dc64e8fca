#include "qtx/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace qtx {
namespace {

bool IsValidRegionName(std::string_view name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == ':' || c == '/' || c == '-';
    if (!ok) return false;
  }
  return true;
}

bool IsValidShmName(std::string_view name) {
  if (name.size() < 2 || name.size() > 255 || name[0] != '/') return false;
  if (name.find('/', 1) != std::string_view::npos) return false;
  return name.find('\0') == std::string_view::npos;
}

absl::Status ErrnoStatus(int err, std::string_view what) {
  const std::string msg = absl::StrCat(std::string(what), ": ", std::strerror(err));
  switch (err) {
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(msg);
    case EINVAL:
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

std::string FreshShmName() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return absl::StrFormat("/qtx-%d-%016x", static_cast<int>(getpid()), r);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(std::string_view name_view,
                                                             uint64_t byte_size,
                                                             std::string_view shm_name) {
  const std::string name(name_view);
  if (!IsValidRegionName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("region name '", name, "': must be 1..128 characters of [A-Za-z0-9_.:/-]"));
  }
  if (byte_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("region '", name, "': byte_size must be > 0"));
  }
  if (byte_size > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("region '", name, "': byte_size ", byte_size, " is too large"));
  }
  std::string shm = shm_name.empty() ? FreshShmName() : std::string(shm_name);
  if (!IsValidShmName(shm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm name '", shm, "': must start with '/', contain no other '/', 2..255 characters"));
  }
  const int fd = shm_open(shm.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("shm_open('", shm, "')"));
  if (ftruncate(fd, static_cast<off_t>(byte_size)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(shm.c_str());
    return ErrnoStatus(err, absl::StrCat("ftruncate('", shm, "', ", byte_size, ")"));
  }
  void* base = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    shm_unlink(shm.c_str());
    return ErrnoStatus(err, absl::StrCat("mmap('", shm, "', ", byte_size, ")"));
  }
  return std::unique_ptr<ShmRegion>(
      new ShmRegion(name, std::move(shm), byte_size, fd, static_cast<std::byte*>(base)));
}

ShmRegion::ShmRegion(std::string name, std::string shm_name, uint64_t size, int fd, std::byte* base)
    : name_(std::move(name)), shm_name_(std::move(shm_name)), size_(size), fd_(fd), base_(base) {}

ShmRegion::~ShmRegion() {
  munmap(base_, size_);
  close(fd_);
  shm_unlink(shm_name_.c_str());
}

absl::StatusOr<RegionSlice> ShmRegion::Allocate(uint64_t byte_size, uint64_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("alignment ", alignment, ": must be a power of two"));
  }
  const uint64_t start = (used_ + alignment - 1) & ~(alignment - 1);
  if (start < used_ || start > size_ || byte_size > size_ - start) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("region '%s': %d bytes (alignment %d) do not fit: %d of %d bytes used",
                        name_, byte_size, alignment, used_, size_));
  }
  used_ = start + byte_size;
  return RegionSlice{name_, start, byte_size};
}

absl::StatusOr<Tensor> ShmRegion::Place(const Tensor& tensor, uint64_t alignment) {
  if (tensor.in_region()) {
    return absl::InvalidArgumentError("Place: tensor is already in a region");
  }
  absl::StatusOr<int64_t> bytes = tensor.ByteSize();
  if (!bytes.ok()) return bytes.status();
  if (static_cast<uint64_t>(*bytes) != tensor.data.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Place: tensor has %d bytes but dtype %s and its shape need %d",
                        tensor.data.size(), DTypeName(tensor.dtype), *bytes));
  }
  absl::StatusOr<RegionSlice> slice = Allocate(tensor.data.size(), alignment);
  if (!slice.ok()) return slice.status();
  if (!tensor.data.empty()) {
    std::memcpy(base_ + slice->offset, tensor.data.data(), tensor.data.size());
  }
  return Tensor::InRegion(tensor.dtype, tensor.shape, *std::move(slice));
}

absl::StatusOr<Tensor> ShmRegion::AllocateTensor(DType dtype, std::vector<int64_t> shape,
                                                 uint64_t alignment) {
  Tensor t = Tensor::InRegion(dtype, std::move(shape), RegionSlice{});
  absl::StatusOr<int64_t> bytes = t.ByteSize();
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<RegionSlice> slice = Allocate(*bytes, alignment);
  if (!slice.ok()) return slice.status();
  t.region = *std::move(slice);
  return t;
}

absl::StatusOr<QuantizeOutputs> ShmRegion::AllocateQuantizeOutputs(std::span<const int64_t> shape,
                                                                   const QuantizeConfig& config,
                                                                   uint64_t alignment) {
  absl::StatusOr<QuantizedLayout> layout = ComputeQuantizedLayout(config.scaling_mode, shape);
  if (!layout.ok()) return layout.status();
  const uint64_t saved = used_;
  QuantizeOutputs out;
  auto take = [&](int64_t bytes, std::optional<RegionSlice>& dst) -> absl::Status {
    absl::StatusOr<RegionSlice> s = Allocate(bytes, alignment);
    if (!s.ok()) return s.status();
    dst = *std::move(s);
    return absl::OkStatus();
  };
  absl::Status st;
  if (config.rowwise) {
    st.Update(take(layout->rowwise_data_rows * layout->rowwise_data_cols, out.rowwise_data));
    if (st.ok()) {
      st.Update(
          take(layout->rowwise_scale_rows * layout->rowwise_scale_cols * 4, out.rowwise_scale_inv));
    }
  }
  if (st.ok() && config.columnwise) {
    st.Update(
        take(layout->columnwise_data_rows * layout->columnwise_data_cols, out.columnwise_data));
    if (st.ok()) {
      st.Update(take(layout->columnwise_scale_rows * layout->columnwise_scale_cols * 4,
                     out.columnwise_scale_inv));
    }
  }
  if (!st.ok()) {
    used_ = saved;  // all or nothing
    return st;
  }
  return out;
}

absl::StatusOr<std::span<std::byte>> ShmRegion::View(const RegionSlice& slice) const {
  if (slice.region != name_) {
    return absl::InvalidArgumentError(
        absl::StrCat("slice of region '", slice.region, "' is not in region '", name_, "'"));
  }
  if (slice.offset > size_ || slice.size > size_ - slice.offset) {
    return absl::InvalidArgumentError(
        absl::StrFormat("region '%s': offset %d + size %d exceeds region size %d", name_,
                        slice.offset, slice.size, size_));
  }
  return std::span<std::byte>(base_ + slice.offset, static_cast<size_t>(slice.size));
}

absl::StatusOr<Tensor> ShmRegion::ToInline(const Tensor& tensor) const {
  if (!tensor.in_region()) return tensor;
  absl::StatusOr<std::span<std::byte>> view = View(*tensor.region);
  if (!view.ok()) return view.status();
  return Tensor::Inline(tensor.dtype, tensor.shape,
                        std::string(reinterpret_cast<const char*>(view->data()), view->size()));
}

}  // namespace qtx

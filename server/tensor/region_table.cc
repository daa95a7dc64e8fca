#include "server/tensor/region_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/tensor/shm_fault_guard.h"

namespace qtx::server::tensor {
namespace {

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == ':' || c == '/' || c == '-';
}

std::string Quoted(std::string_view s) {
  // Names in messages are bounded and printable-escaped.
  std::string out;
  for (char c : s.substr(0, 160)) {
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(c);
    } else {
      out += absl::StrFormat("\\x%02x", static_cast<unsigned char>(c));
    }
  }
  if (s.size() > 160) out += "...";
  return "'" + out + "'";
}

// Closes a file descriptor on scope exit.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  // Hands the descriptor over; the closer no longer closes it.
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

}  // namespace

absl::Status ValidateRegionName(std::string_view name, std::string_view field) {
  if (name.empty() || name.size() > kMaxRegionNameLength) {
    return absl::InvalidArgumentError(absl::StrFormat("%s=%s: length %d, must be 1..%d characters",
                                                      field, Quoted(name), name.size(),
                                                      kMaxRegionNameLength));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    if (!IsNameChar(name[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s=%s: character %d is not one of [A-Za-z0-9_.:/-]", field, Quoted(name), i));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateShmName(std::string_view shm_name, std::string_view field) {
  if (shm_name.size() < 2 || shm_name.size() > 255 || shm_name[0] != '/') {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s=%s: must be '/' followed by 1..254 characters (e.g. \"/qtx-trainer-0\")", field,
        Quoted(shm_name)));
  }
  for (size_t i = 1; i < shm_name.size(); ++i) {
    if (shm_name[i] == '/' || shm_name[i] == '\0') {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s=%s: only the first character may be '/', and NUL is not allowed",
                          field, Quoted(shm_name)));
    }
  }
  return absl::OkStatus();
}

Region::Region(std::string name, RegionKind kind, std::string shm_name, int32_t device_id,
               uint64_t byte_size, MappedMemory memory, uint64_t session)
    : name_(std::move(name)),
      kind_(kind),
      shm_name_(std::move(shm_name)),
      device_id_(device_id),
      byte_size_(byte_size),
      memory_(std::move(memory)),
      session_(session) {}

Region::~Region() {
  if (memory_.release) memory_.release();
}

absl::Status Region::Intact() const {
  if (!memory_.faulted || !memory_.faulted()) return absl::OkStatus();
  return absl::DataLossError(absl::StrFormat(
      "region %s: shm object %s was truncated while this request used it; the bytes read from "
      "or written to it are not the client's, so the result is discarded. Unregister the region "
      "and register it again once the object is large enough",
      Quoted(name_), Quoted(shm_name_)));
}

absl::Status CheckIntact(const std::shared_ptr<const Region>& pin) {
  return pin == nullptr ? absl::OkStatus() : pin->Intact();
}

RegionTable::RegionTable(RegionTableOptions options) : options_(std::move(options)) {}

absl::Status RegionTable::CheckNameFree(std::string_view name) const {
  absl::MutexLock lock(&mu_);
  if (regions_.find(name) != regions_.end()) {
    return absl::AlreadyExistsError(
        absl::StrFormat("region %s is already registered (unregister it first)", Quoted(name)));
  }
  if (regions_.size() >= options_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cannot register region %s: the server already holds the maximum of %d regions",
        Quoted(name), options_.max_regions));
  }
  return absl::OkStatus();
}

absl::Status RegionTable::Insert(std::shared_ptr<Region> region) {
  absl::MutexLock lock(&mu_);
  if (regions_.find(region->name()) != regions_.end()) {
    // Lost a race with a concurrent registration of the same name; `region`
    // releases its mapping when it goes out of scope.
    return absl::AlreadyExistsError(absl::StrFormat(
        "region %s is already registered (unregister it first)", Quoted(region->name())));
  }
  if (regions_.size() >= options_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cannot register region %s: the server already holds the maximum of %d regions",
        Quoted(region->name()), options_.max_regions));
  }
  std::string key = region->name();
  regions_.emplace(std::move(key), std::move(region));
  return absl::OkStatus();
}

absl::Status RegionTable::RegisterShm(std::string_view name, std::string_view shm_name,
                                      uint64_t offset, uint64_t byte_size) {
  QTX_RETURN_IF_ERROR(ValidateRegionName(name, "name"));
  if (!options_.allow_client_shm) {
    return absl::FailedPreconditionError(
        "shm regions are disabled on this server: start qtxd with --allow_client_shm");
  }
  QTX_RETURN_IF_ERROR(ValidateShmName(shm_name, "shm.shm_name"));
  if (byte_size == 0) {
    return absl::InvalidArgumentError("shm.byte_size=0: must be > 0");
  }
  QTX_RETURN_IF_ERROR(CheckNameFree(name));

  const std::string shm(shm_name);
  const int fd = ::shm_open(shm.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(
          absl::StrFormat("shm.shm_name=%s: no such shared-memory object", Quoted(shm_name)));
    }
    if (err == EACCES) {
      return absl::PermissionDeniedError(
          absl::StrFormat("shm.shm_name=%s: the server may not open it read-write (%s)",
                          Quoted(shm_name), std::strerror(err)));
    }
    return absl::InvalidArgumentError(absl::StrFormat("shm.shm_name=%s: shm_open failed: %s",
                                                      Quoted(shm_name), std::strerror(err)));
  }
  FdCloser closer(fd);  // released below once the region owns the descriptor
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrFormat("shm.shm_name=%s: fstat failed: %s",
                                               Quoted(shm_name), std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shm.shm_name=%s: not a regular shared-memory object", Quoted(shm_name)));
  }
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  // Overflow-safe form of offset + byte_size <= object_size.
  if (offset > object_size || byte_size > object_size - offset) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "region %s: shm.offset %d + shm.byte_size %d exceeds the size %d of shm object %s",
        Quoted(name), offset, byte_size, object_size, Quoted(shm_name)));
  }
  const long page = ::sysconf(_SC_PAGESIZE);
  const uint64_t page_size = page > 0 ? static_cast<uint64_t>(page) : 4096;
  const uint64_t map_offset = offset - offset % page_size;
  const uint64_t delta = offset - map_offset;
  const uint64_t map_len = delta + byte_size;  // <= object_size: cannot overflow
  void* base = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                      static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    const int err = errno;
    if (err == ENOMEM) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "region %s: cannot map %d bytes: %s", Quoted(name), map_len, std::strerror(err)));
    }
    return absl::InvalidArgumentError(absl::StrFormat("region %s: mmap of shm object %s failed: %s",
                                                      Quoted(name), Quoted(shm_name),
                                                      std::strerror(err)));
  }
  MappedMemory memory;
  memory.data = static_cast<std::byte*>(base) + delta;
  // The descriptor stays open for the size check on every pin: a client that
  // truncates the object after registering it would make the next access
  // fault (SIGBUS); the check refuses the pin instead.
  // A truncation while a request touches the mapping raises SIGBUS: the
  // guard absorbs it and marks the watch (see shm_fault_guard.h).
  absl::StatusOr<int> watch = ShmFaultGuard::Watch(base, map_len);
  if (!watch.ok()) {
    ::munmap(base, map_len);
    return watch.status();
  }
  const int watch_id = *watch;
  const int kept_fd = closer.Release();
  memory.release = [base, map_len, kept_fd, watch_id] {
    ShmFaultGuard::Unwatch(watch_id);
    ::munmap(base, map_len);
    ::close(kept_fd);
  };
  memory.faulted = [watch_id] { return ShmFaultGuard::Faulted(watch_id); };
  const uint64_t needed = offset + byte_size;  // checked above: no overflow
  memory.check = [kept_fd, needed, watch_id, name = std::string(name), shm]() -> absl::Status {
    if (ShmFaultGuard::Faulted(watch_id)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "region %s: shm object %s was truncated while a request used it, and the server's "
          "mapping no longer shows it; unregister the region and register it again",
          Quoted(name), Quoted(shm)));
    }
    struct stat now;
    if (::fstat(kept_fd, &now) != 0) {
      return absl::InternalError(absl::StrFormat("region %s: fstat of shm object %s failed: %s",
                                                 Quoted(name), Quoted(shm), std::strerror(errno)));
    }
    if (static_cast<uint64_t>(now.st_size) < needed) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "region %s: shm object %s shrank to %d bytes after registration, below the registered "
          "range's end %d (offset + byte_size); unregister the region and register it again "
          "once the object is large enough",
          Quoted(name), Quoted(shm), static_cast<int64_t>(now.st_size), needed));
    }
    return absl::OkStatus();
  };
  auto region = std::make_shared<Region>(std::string(name), RegionKind::kShm, shm, 0, byte_size,
                                         std::move(memory));
  return Insert(std::move(region));
}

absl::Status RegionTable::RegisterCudaIpc(std::string_view name, std::string_view ipc_handle,
                                          int32_t device_id, uint64_t byte_size,
                                          std::string_view device_uuid) {
  QTX_RETURN_IF_ERROR(ValidateRegionName(name, "name"));
  if (ipc_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda_ipc.ipc_handle: %d bytes, must be exactly %d (a cudaIpcMemHandle_t)",
                        ipc_handle.size(), kCudaIpcHandleBytes));
  }
  if (device_id < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda_ipc.device_id=%d: must be >= 0", device_id));
  }
  if (byte_size == 0) {
    return absl::InvalidArgumentError("cuda_ipc.byte_size=0: must be > 0");
  }
  if (!options_.cuda_ipc_opener) {
    return absl::FailedPreconditionError(
        absl::StrFormat("region %s: %s", Quoted(name), options_.cuda_ipc_unavailable_reason));
  }
  if (!device_uuid.empty()) {
    if (device_uuid.size() != 16) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuda_ipc.device_uuid: %d bytes, must be 16 (cudaDeviceProp::uuid)", device_uuid.size()));
    }
    if (!options_.cuda_uuid_resolver) {
      return absl::FailedPreconditionError(
          absl::StrFormat("region %s: %s", Quoted(name), options_.cuda_ipc_unavailable_reason));
    }
    QTX_ASSIGN_OR_RETURN(device_id, options_.cuda_uuid_resolver(device_uuid));
  }
  QTX_RETURN_IF_ERROR(CheckNameFree(name));
  QTX_ASSIGN_OR_RETURN(MappedMemory memory,
                       options_.cuda_ipc_opener(ipc_handle, device_id, byte_size));
  auto region = std::make_shared<Region>(std::string(name), RegionKind::kCudaIpc, "", device_id,
                                         byte_size, std::move(memory));
  return Insert(std::move(region));
}

absl::Status RegionTable::RegisterCudaVmm(std::string_view name, std::span<const int> fds,
                                          std::span<const uint64_t> chunk_sizes, uint64_t offset,
                                          uint64_t byte_size, std::string_view device_uuid,
                                          uint64_t session) {
  QTX_RETURN_IF_ERROR(ValidateRegionName(name, "name"));
  if (chunk_sizes.empty()) {
    return absl::InvalidArgumentError("cuda_vmm.chunks: empty (one entry per physical chunk)");
  }
  if (chunk_sizes.size() != fds.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda_vmm.chunks: %d chunks but the fd tokens carry %d descriptors (one per chunk)",
        chunk_sizes.size(), fds.size()));
  }
  uint64_t total = 0;
  for (size_t i = 0; i < chunk_sizes.size(); ++i) {
    if (chunk_sizes[i] == 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cuda_vmm.chunks[%d].size=0: must be > 0", i));
    }
    if (chunk_sizes[i] > UINT64_MAX - total) {
      return absl::InvalidArgumentError("cuda_vmm.chunks: the sizes overflow 64 bits");
    }
    total += chunk_sizes[i];
  }
  if (byte_size == 0) {
    return absl::InvalidArgumentError("cuda_vmm.byte_size=0: must be > 0");
  }
  if (offset > total || byte_size > total - offset) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda_vmm.offset %d + byte_size %d exceeds the %d bytes of the %d chunks",
                        offset, byte_size, total, chunk_sizes.size()));
  }
  if (device_uuid.size() != 16) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda_vmm.device_uuid: %d bytes, must be 16 (cudaDeviceProp::uuid)", device_uuid.size()));
  }
  if (!options_.cuda_vmm_opener || !options_.cuda_uuid_resolver) {
    return absl::FailedPreconditionError(
        absl::StrFormat("region %s: %s", Quoted(name), options_.cuda_ipc_unavailable_reason));
  }
  QTX_ASSIGN_OR_RETURN(const int32_t device_id, options_.cuda_uuid_resolver(device_uuid));
  QTX_RETURN_IF_ERROR(CheckNameFree(name));
  QTX_ASSIGN_OR_RETURN(MappedMemory memory,
                       options_.cuda_vmm_opener(fds, chunk_sizes, device_id, offset, byte_size));
  auto region = std::make_shared<Region>(std::string(name), RegionKind::kCudaVmm, "", device_id,
                                         byte_size, std::move(memory), session);
  return Insert(std::move(region));
}

size_t RegionTable::UnregisterSession(uint64_t session) {
  std::vector<std::shared_ptr<Region>> removed;  // released outside the lock
  {
    absl::MutexLock lock(&mu_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (session != 0 && it->second->session() == session) {
        removed.push_back(std::move(it->second));
        it = regions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  return removed.size();
}

absl::Status RegionTable::Unregister(std::string_view name) {
  std::shared_ptr<Region> removed;  // released outside the lock
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrFormat("region %s is not registered", Quoted(name)));
    }
    removed = std::move(it->second);
    regions_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Region>> RegionTable::Acquire(std::string_view name) const {
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrFormat(
          "region %s is not registered (register it with Memory.RegisterRegion)", Quoted(name)));
    }
    region = it->second;
  }
  if (region->memory_.check) QTX_RETURN_IF_ERROR(region->memory_.check());
  region->pins_.fetch_add(1, std::memory_order_relaxed);
  Region* raw = region.get();
  // The deleter owns a reference, so the mapping lives as long as any copy
  // of the pin; dropping the last copy decrements the pin count.
  return std::shared_ptr<const Region>(raw, [owner = std::move(region)](const Region*) mutable {
    owner->pins_.fetch_sub(1, std::memory_order_relaxed);
    owner.reset();
  });
}

std::vector<RegionInfo> RegionTable::List() const {
  std::vector<RegionInfo> out;
  {
    absl::MutexLock lock(&mu_);
    out.reserve(regions_.size());
    for (const auto& [name, r] : regions_) {
      RegionInfo info;
      info.name = name;
      info.kind = r->kind();
      info.byte_size = r->byte_size();
      info.shm_name = r->shm_name();
      info.device_id = r->device_id();
      info.in_use = r->in_use();
      out.push_back(std::move(info));
    }
  }
  return out;
}

size_t RegionTable::size() const {
  absl::MutexLock lock(&mu_);
  return regions_.size();
}

}  // namespace qtx::server::tensor

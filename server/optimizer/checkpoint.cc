#include "server/optimizer/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace qtx::server::optimizer {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint format is little-endian; add byte swapping for this host");

constexpr char kMagic[8] = {'Q', 'T', 'X', 'O', 'P', 'T', 'C', 'K'};
constexpr uint64_t kHeaderBytes = 8 + 4 + 4 + 8 + 8;
constexpr int kMaxRank = 16;
constexpr uint64_t kMaxMetaBytes = uint64_t{1} << 30;

uint32_t Crc(uint32_t crc, const void* data, uint64_t size) {
  const auto* p = static_cast<const Bytef*>(data);
  while (size > 0) {
    const uInt chunk = static_cast<uInt>(std::min<uint64_t>(size, uint64_t{1} << 30));
    crc = static_cast<uint32_t>(crc32(crc, p, chunk));
    p += chunk;
    size -= chunk;
  }
  return crc;
}

absl::Status Errno(std::string_view what, const std::string& path) {
  const int err = errno;
  // A full disk, quota or file-size limit is something the operator can fix:
  // RESOURCE_EXHAUSTED, not INTERNAL.
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "checkpoint %s '%s': %s (free space in --checkpoint_dir)", what, path, std::strerror(err)));
  }
  return absl::InternalError(
      absl::StrFormat("checkpoint %s '%s': %s", what, path, std::strerror(err)));
}

// Appends to a file descriptor with a running CRC.
class Writer {
 public:
  Writer(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  absl::Status Write(const void* data, uint64_t size) {
    crc_ = Crc(crc_, data, size);
    return WriteRaw(data, size);
  }
  absl::Status WriteRaw(const void* data, uint64_t size) {
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, std::min<uint64_t>(size, uint64_t{1} << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Errno("write", path_);
      }
      p += n;
      size -= static_cast<uint64_t>(n);
      bytes_ += static_cast<uint64_t>(n);
    }
    return absl::OkStatus();
  }
  uint32_t crc() const { return crc_; }
  uint64_t bytes() const { return bytes_; }

 private:
  int fd_;
  std::string path_;
  uint32_t crc_ = static_cast<uint32_t>(crc32(0, nullptr, 0));
  uint64_t bytes_ = 0;
};

// The metadata section, serialized into memory.
class MetaBuilder {
 public:
  template <typename T>
  void Put(T v) {
    const size_t at = buf_.size();
    buf_.resize(at + sizeof(T));
    std::memcpy(buf_.data() + at, &v, sizeof(T));
  }
  void PutString(std::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    buf_.append(s.data(), s.size());
  }
  const std::string& bytes() const { return buf_; }

 private:
  std::string buf_;
};

// Reads the metadata section with bounds checks.
class MetaReader {
 public:
  MetaReader(std::string_view buf, std::string path) : buf_(buf), path_(std::move(path)) {}
  template <typename T>
  absl::Status Get(T* v) {
    if (buf_.size() - pos_ < sizeof(T)) return Truncated();
    std::memcpy(v, buf_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }
  absl::Status GetString(std::string* s) {
    uint32_t len = 0;
    QTX_RETURN_IF_ERROR(Get(&len));
    if (buf_.size() - pos_ < len) return Truncated();
    s->assign(buf_.data() + pos_, len);
    pos_ += len;
    return absl::OkStatus();
  }
  bool done() const { return pos_ == buf_.size(); }

 private:
  absl::Status Truncated() const {
    return absl::DataLossError(
        absl::StrFormat("checkpoint '%s': metadata ends early (corrupted)", path_));
  }
  std::string_view buf_;
  size_t pos_ = 0;
  std::string path_;
};

// The version `s` is written as: 3 when a parameter has a shard range, 2
// when one has its own settings, else 1 (the oldest that holds it all).
uint32_t VersionFor(const GroupState& s) {
  uint32_t v = 1;
  for (const ParamState& p : s.params) {
    if (p.info.shard.has_value()) return 3;
    if (!p.info.hyper.empty()) v = 2;
  }
  return v;
}

std::string BuildMeta(const GroupState& s, uint32_t version) {
  MetaBuilder b;
  const GroupConfig& c = s.config;
  b.PutString(c.name);
  b.Put<int64_t>(c.step);
  b.Put<int64_t>(s.update_count);
  b.Put<double>(c.hyper.lr);
  b.Put<double>(c.hyper.beta1);
  b.Put<double>(c.hyper.beta2);
  b.Put<double>(c.hyper.eps);
  b.Put<double>(c.hyper.weight_decay);
  b.Put<uint8_t>(c.hyper.bias_correction);
  b.Put<uint8_t>(static_cast<uint8_t>(c.moment_dtype));
  b.Put<uint8_t>(c.output.fp8);
  b.Put<uint8_t>(static_cast<uint8_t>(c.output.quant.scaling));
  b.Put<uint8_t>(static_cast<uint8_t>(c.output.quant.format));
  b.Put<uint8_t>(c.output.quant.rowwise);
  b.Put<uint8_t>(c.output.quant.columnwise);
  b.Put<uint8_t>(c.output.quant.force_pow2_scales);
  b.Put<float>(c.output.quant.amax_epsilon);
  b.Put<uint8_t>(c.output.bf16_copy);
  b.Put<uint8_t>(s.last.has_value());
  const StepStats last = s.last.value_or(StepStats{});
  b.Put<int64_t>(last.step);
  b.Put<double>(last.grad_norm);
  b.Put<uint8_t>(last.skipped);
  b.Put<uint8_t>(last.non_finite);
  b.Put<double>(last.clip_coef);
  b.Put<double>(last.lr);
  b.Put<uint32_t>(static_cast<uint32_t>(s.params.size()));
  for (const ParamState& p : s.params) {
    b.PutString(p.info.name);
    b.Put<uint32_t>(static_cast<uint32_t>(p.info.shape.size()));
    for (int64_t d : p.info.shape) b.Put<int64_t>(d);
    b.Put<int64_t>(p.info.m);
    b.Put<int64_t>(p.info.n);
    if (version >= 2) {
      const ParameterHyper& h = p.info.hyper;
      b.Put<uint8_t>((h.weight_decay.has_value() ? 1 : 0) | (h.lr_scale.has_value() ? 2 : 0));
      b.Put<double>(h.weight_decay.value_or(0.0));
      b.Put<double>(h.lr_scale.value_or(1.0));
    }
    if (version >= 3) {
      b.Put<uint8_t>(p.info.shard.has_value());
      b.Put<int64_t>(p.info.shard.has_value() ? p.info.shard->begin : 0);
      b.Put<int64_t>(p.info.shard.has_value() ? p.info.shard->end : 0);
    }
  }
  return b.bytes();
}

absl::Status ParseMeta(MetaReader& r, GroupState* s, const std::string& path, uint32_t version) {
  GroupConfig& c = s->config;
  uint8_t u8 = 0;
  QTX_RETURN_IF_ERROR(r.GetString(&c.name));
  QTX_RETURN_IF_ERROR(r.Get(&c.step));
  QTX_RETURN_IF_ERROR(r.Get(&s->update_count));
  QTX_RETURN_IF_ERROR(r.Get(&c.hyper.lr));
  QTX_RETURN_IF_ERROR(r.Get(&c.hyper.beta1));
  QTX_RETURN_IF_ERROR(r.Get(&c.hyper.beta2));
  QTX_RETURN_IF_ERROR(r.Get(&c.hyper.eps));
  QTX_RETURN_IF_ERROR(r.Get(&c.hyper.weight_decay));
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  c.hyper.bias_correction = u8 != 0;
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  if (u8 > 1)
    return absl::DataLossError(absl::StrFormat("checkpoint '%s': bad moment dtype", path));
  c.moment_dtype = static_cast<kernels::MomentDType>(u8);
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  c.output.fp8 = u8 != 0;
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  if (u8 > static_cast<uint8_t>(kernels::BlockScaling::kTensor)) {
    return absl::DataLossError(absl::StrFormat("checkpoint '%s': bad scaling", path));
  }
  c.output.quant.scaling = static_cast<kernels::BlockScaling>(u8);
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  if (u8 > 1) return absl::DataLossError(absl::StrFormat("checkpoint '%s': bad FP8 format", path));
  c.output.quant.format = static_cast<kernels::Fp8Format>(u8);
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  c.output.quant.rowwise = u8 != 0;
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  c.output.quant.columnwise = u8 != 0;
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  c.output.quant.force_pow2_scales = u8 != 0;
  QTX_RETURN_IF_ERROR(r.Get(&c.output.quant.amax_epsilon));
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  c.output.bf16_copy = u8 != 0;
  uint8_t has_last = 0;
  QTX_RETURN_IF_ERROR(r.Get(&has_last));
  StepStats last;
  QTX_RETURN_IF_ERROR(r.Get(&last.step));
  QTX_RETURN_IF_ERROR(r.Get(&last.grad_norm));
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  last.skipped = u8 != 0;
  QTX_RETURN_IF_ERROR(r.Get(&u8));
  last.non_finite = u8 != 0;
  QTX_RETURN_IF_ERROR(r.Get(&last.clip_coef));
  QTX_RETURN_IF_ERROR(r.Get(&last.lr));
  if (has_last) s->last = last;
  uint32_t count = 0;
  QTX_RETURN_IF_ERROR(r.Get(&count));
  s->params.clear();
  s->params.reserve(std::min<uint32_t>(count, 1u << 20));
  for (uint32_t i = 0; i < count; ++i) {
    ParamState p;
    QTX_RETURN_IF_ERROR(r.GetString(&p.info.name));
    uint32_t rank = 0;
    QTX_RETURN_IF_ERROR(r.Get(&rank));
    if (rank < 1 || rank > kMaxRank) {
      return absl::DataLossError(
          absl::StrFormat("checkpoint '%s': parameter %d has rank %d", path, i, rank));
    }
    p.info.shape.resize(rank);
    for (auto& d : p.info.shape) QTX_RETURN_IF_ERROR(r.Get(&d));
    QTX_RETURN_IF_ERROR(r.Get(&p.info.m));
    QTX_RETURN_IF_ERROR(r.Get(&p.info.n));
    if (version >= 2) {
      uint8_t flags = 0;
      double wd = 0.0, scale = 1.0;
      QTX_RETURN_IF_ERROR(r.Get(&flags));
      QTX_RETURN_IF_ERROR(r.Get(&wd));
      QTX_RETURN_IF_ERROR(r.Get(&scale));
      if (flags > 3) {
        return absl::DataLossError(absl::StrFormat(
            "checkpoint '%s': parameter '%s' has bad settings flags %d", path, p.info.name, flags));
      }
      if (flags & 1) p.info.hyper.weight_decay = wd;
      if (flags & 2) p.info.hyper.lr_scale = scale;
    }
    if (version >= 3) {
      uint8_t has_shard = 0;
      kernels::ElementRange range;
      QTX_RETURN_IF_ERROR(r.Get(&has_shard));
      QTX_RETURN_IF_ERROR(r.Get(&range.begin));
      QTX_RETURN_IF_ERROR(r.Get(&range.end));
      if (has_shard > 1) {
        return absl::DataLossError(
            absl::StrFormat("checkpoint '%s': parameter '%s' has a bad shard flag %d", path,
                            p.info.name, has_shard));
      }
      if (has_shard) p.info.shard = range;
    }
    // The matrix must agree with the shape (overflow-safe).
    int64_t elements = 1;
    for (int64_t d : p.info.shape) {
      if (d < 0 || (d > 0 && elements > (int64_t{1} << 40) / d)) {
        return absl::DataLossError(
            absl::StrFormat("checkpoint '%s': parameter '%s' has a bad shape", path, p.info.name));
      }
      elements *= d;
    }
    if (p.info.n != p.info.shape.back() || p.info.m < 0 || p.info.m * p.info.n != elements) {
      return absl::DataLossError(absl::StrFormat(
          "checkpoint '%s': parameter '%s' matrix [%d, %d] does not match its shape", path,
          p.info.name, p.info.m, p.info.n));
    }
    s->params.push_back(std::move(p));
  }
  if (!r.done()) {
    return absl::DataLossError(
        absl::StrFormat("checkpoint '%s': trailing bytes after the metadata", path));
  }
  return absl::OkStatus();
}

// The checksum only proves the file is the one that was written; a file
// edited by hand (with a recomputed checksum) or written by a faulty qtxd can
// still hold values no request could have set. Checks every loaded value
// with the rules OffloadOptimizerState applies (ValidateGroupConfig and the
// parameter names), plus the counters' own invariants.
absl::Status ValidateLoadedState(const GroupState& s) {
  const GroupConfig& c = s.config;
  QTX_RETURN_IF_ERROR(ValidateGroupConfig(c));
  if (s.update_count < 0 || s.update_count > c.step) {
    return absl::InvalidArgumentError(
        absl::StrFormat("update_count=%d: must be 0..step (%d)", s.update_count, c.step));
  }
  if (s.last.has_value()) {
    const StepStats& l = *s.last;
    if (l.step != c.step) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "last step result is for step %d, the group is at step %d", l.step, c.step));
    }
    if (!std::isfinite(l.lr) || l.lr < 0.0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("last step's lr=%g: must be finite and >= 0", l.lr));
    }
    // clip_coef: at most 1 from max_grad_norm; any finite factor > 0 from a
    // two-phase step's clip_factor.
    if (!(std::isfinite(l.clip_coef) && l.clip_coef > 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("last step's clip_coef=%g: must be finite and > 0", l.clip_coef));
    }
  }
  absl::flat_hash_set<std::string_view> names;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const std::string& name = s.params[i].info.name;
    if (name.empty() || name.size() > 256) {
      return absl::InvalidArgumentError(
          absl::StrFormat("parameters[%d].name='%s': must be 1..256 characters", i, name));
    }
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("parameters[%d].name='%s': duplicate parameter name", i, name));
    }
    QTX_RETURN_IF_ERROR(ValidateParameterHyper(s.params[i].info.hyper,
                                               absl::StrFormat("parameters[%d] ('%s')", i, name)));
  }
  std::vector<ParameterInfo> infos;
  infos.reserve(s.params.size());
  for (const ParamState& p : s.params) infos.push_back(p.info);
  return ValidateShards(c, infos);
}

// Reads exactly `size` bytes, updating the CRC.
absl::Status ReadFully(int fd, void* dst, uint64_t size, uint32_t* crc, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  uint64_t left = size;
  while (left > 0) {
    const ssize_t n = ::read(fd, p, std::min<uint64_t>(left, uint64_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("read", path);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrFormat("checkpoint '%s': file ends early", path));
    }
    p += n;
    left -= static_cast<uint64_t>(n);
  }
  if (crc != nullptr) *crc = Crc(*crc, dst, size);
  return absl::OkStatus();
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = other.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Creates a new temp file next to `path` for an atomic replace:
// "<path>.tmp.<pid>.<16 random hex digits>", opened O_CREAT | O_EXCL |
// O_NOFOLLOW, so that a file or symbolic link planted under a guessed name is
// never opened, followed or truncated (an existing name is skipped).
absl::StatusOr<Fd> CreateTempFile(const std::string& path, std::string* tmp) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    uint64_t nonce = 0;
    if (::getrandom(&nonce, sizeof(nonce), 0) != static_cast<ssize_t>(sizeof(nonce))) {
      return Errno("random name for a temp file of", path);
    }
    *tmp = absl::StrFormat("%s.tmp.%d.%016x", path, ::getpid(), nonce);
    Fd fd(::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (fd.get() >= 0) return fd;
    if (errno != EEXIST) return Errno("create", *tmp);
  }
  return absl::InternalError(absl::StrFormat(
      "checkpoint '%s': 16 random temp file names were all taken; is something creating files "
      "in --checkpoint_dir?",
      path));
}

const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

absl::Status NotRegular(const std::string& path, mode_t mode) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "checkpoint '%s' is %s, not a regular file: qtxd reads only regular files and follows no "
      "links in --checkpoint_dir; remove or replace it",
      path, FileKind(mode)));
}

// Opens an existing checkpoint for reading: a regular file only, never
// through a symbolic link, and without blocking (a FIFO would block open and
// read forever). NOT_FOUND when absent; FAILED_PRECONDITION when it is not a
// regular file; INTERNAL on other errors.
absl::StatusOr<Fd> OpenRegularFile(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrFormat("no checkpoint at '%s'", path));
    return Errno("stat", path);
  }
  // Checked before open too, so that no device or FIFO is ever opened.
  if (!S_ISREG(st.st_mode)) return NotRegular(path, st.st_mode);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrFormat("no checkpoint at '%s'", path));
    if (errno == ELOOP) return NotRegular(path, S_IFLNK);
    return Errno("open", path);
  }
  // It may have been swapped between lstat and open.
  if (::fstat(fd.get(), &st) != 0) return Errno("stat", path);
  if (!S_ISREG(st.st_mode)) return NotRegular(path, st.st_mode);
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return Errno("fcntl", path);
  }
  return fd;
}

}  // namespace

std::string CheckpointPath(const std::string& dir, std::string_view group) {
  return dir + "/" + std::string(group) + std::string(kCheckpointSuffix);
}

std::string PreviousCheckpointPath(const std::string& dir, std::string_view group) {
  return CheckpointPath(dir, group) + std::string(kPreviousSuffix);
}

absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir, const GroupState& state,
                                         bool keep_previous) {
  const std::string path = CheckpointPath(dir, state.config.name);
  const uint32_t version = VersionFor(state);
  const std::string meta = BuildMeta(state, version);
  const uint64_t mb = MomentBytes(state.config.moment_dtype);
  uint64_t data_bytes = 0;
  for (const ParamState& p : state.params) {
    data_bytes += static_cast<uint64_t>(p.info.count()) * (4 + 2 * mb);
  }
  std::string tmp;
  QTX_ASSIGN_OR_RETURN(Fd fd, CreateTempFile(path, &tmp));
  auto write_all = [&]() -> absl::Status {
    Writer w(fd.get(), tmp);
    QTX_RETURN_IF_ERROR(w.Write(kMagic, sizeof(kMagic)));
    const uint32_t reserved = 0;
    const uint64_t meta_bytes = meta.size();
    QTX_RETURN_IF_ERROR(w.Write(&version, 4));
    QTX_RETURN_IF_ERROR(w.Write(&reserved, 4));
    QTX_RETURN_IF_ERROR(w.Write(&meta_bytes, 8));
    QTX_RETURN_IF_ERROR(w.Write(&data_bytes, 8));
    QTX_RETURN_IF_ERROR(w.Write(meta.data(), meta.size()));
    for (const ParamState& p : state.params) {
      const uint64_t count = static_cast<uint64_t>(p.info.count());
      QTX_RETURN_IF_ERROR(w.Write(p.master.get(), count * 4));
      QTX_RETURN_IF_ERROR(w.Write(p.exp_avg.get(), count * mb));
      QTX_RETURN_IF_ERROR(w.Write(p.exp_avg_sq.get(), count * mb));
    }
    const uint32_t crc = w.crc();
    QTX_RETURN_IF_ERROR(w.WriteRaw(&crc, 4));
    if (::fsync(fd.get()) != 0) return Errno("fsync", tmp);
    if (::close(fd.release()) != 0) return Errno("close", tmp);
    return absl::OkStatus();
  };
  absl::Status s = write_all();
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  if (keep_previous) {
    // Keep the checkpoint being replaced as .prev: link it there first, so
    // `path` itself is never missing (a crash in between leaves the newest
    // intact and at worst no .prev).
    const std::string prev = PreviousCheckpointPath(dir, state.config.name);
    if (::unlink(prev.c_str()) != 0 && errno != ENOENT) {
      absl::Status e = Errno("remove old", prev);
      ::unlink(tmp.c_str());
      return e;
    }
    if (::link(path.c_str(), prev.c_str()) != 0 && errno != ENOENT) {
      absl::Status e = Errno("keep previous as", prev);
      ::unlink(tmp.c_str());
      return e;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status e = Errno("rename to", path);
    ::unlink(tmp.c_str());
    return e;
  }
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0) return Errno("open directory", dir);
  if (::fsync(dfd.get()) != 0) return Errno("fsync directory", dir);
  return kHeaderBytes + meta.size() + data_bytes + 4;
}

namespace {

// An opened checkpoint whose header and metadata were read and checked: the
// file position is at the start of the data section, `crc` covers every byte
// before it, `state` has the parameter table without buffers.
struct OpenedCheckpoint {
  Fd fd{-1};
  uint32_t crc = 0;
  GroupState state;
};

absl::StatusOr<OpenedCheckpoint> OpenCheckpoint(const std::string& path) {
  OpenedCheckpoint out;
  QTX_ASSIGN_OR_RETURN(out.fd, OpenRegularFile(path));
  const Fd& fd = out.fd;
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Errno("stat", path);
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < kHeaderBytes + 4) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint '%s': %d bytes is shorter than the header (corrupted or truncated)", path,
        file_size));
  }
  uint32_t crc = static_cast<uint32_t>(crc32(0, nullptr, 0));
  char header[kHeaderBytes];
  QTX_RETURN_IF_ERROR(ReadFully(fd.get(), header, kHeaderBytes, &crc, path));
  if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(
        absl::StrFormat("checkpoint '%s': bad magic (not a qtx optimizer checkpoint)", path));
  }
  uint32_t version;
  uint64_t meta_bytes, data_bytes;
  std::memcpy(&version, header + 8, 4);
  std::memcpy(&meta_bytes, header + 16, 8);
  std::memcpy(&data_bytes, header + 24, 8);
  if (version < 1 || version > kCheckpointVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint '%s': format version %d is not supported (this qtxd reads versions 1 to %d)",
        path, version, kCheckpointVersion));
  }
  if (meta_bytes > kMaxMetaBytes || data_bytes > file_size ||
      kHeaderBytes + meta_bytes + data_bytes + 4 != file_size) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint '%s': header sizes (meta %d + data %d bytes) do not match the file size %d "
        "(corrupted or truncated)",
        path, meta_bytes, data_bytes, file_size));
  }
  std::string meta(meta_bytes, '\0');
  QTX_RETURN_IF_ERROR(ReadFully(fd.get(), meta.data(), meta_bytes, &crc, path));
  GroupState& state = out.state;
  MetaReader r(meta, path);
  QTX_RETURN_IF_ERROR(ParseMeta(r, &state, path, version));
  if (absl::Status v = ValidateLoadedState(state); !v.ok()) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint '%s' holds an impossible value: %s (its checksum matches, so it was edited "
        "or written by a faulty qtxd); refusing to load it",
        path, v.message()));
  }
  const uint64_t mb = MomentBytes(state.config.moment_dtype);
  uint64_t expect_data = 0;
  for (const ParamState& p : state.params) {
    // Each parameter's bytes are below 2^44 (ParseMeta), and data_bytes below
    // the file size: stopping once past it keeps the sums from overflowing.
    expect_data += static_cast<uint64_t>(p.info.count()) * (4 + 2 * mb);
    if (expect_data > data_bytes) break;
  }
  if (expect_data != data_bytes) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint '%s': parameter table needs %d data bytes, header says %d (corrupted)", path,
        expect_data, data_bytes));
  }
  out.crc = crc;
  return out;
}

// Reads the trailing checksum and compares it with `crc`.
absl::Status VerifyChecksum(const Fd& fd, uint32_t crc, const std::string& path) {
  uint32_t stored = 0;
  QTX_RETURN_IF_ERROR(ReadFully(fd.get(), &stored, 4, nullptr, path));
  if (stored != crc) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint '%s': checksum mismatch (stored CRC-32 0x%08x, computed 0x%08x): the file "
        "is corrupted; refusing to load it",
        path, stored, crc));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GroupState> ReadCheckpoint(
    const std::string& path, const std::function<absl::Status(uint64_t bytes)>& reserve) {
  QTX_ASSIGN_OR_RETURN(OpenedCheckpoint opened, OpenCheckpoint(path));
  const Fd& fd = opened.fd;
  uint32_t crc = opened.crc;
  GroupState state = std::move(opened.state);
  const uint64_t mb = MomentBytes(state.config.moment_dtype);
  int64_t elements = 0;
  for (const ParamState& p : state.params) elements += p.info.count();
  QTX_RETURN_IF_ERROR(reserve(StateBytes(elements, state.config.moment_dtype)));
  for (ParamState& p : state.params) {
    QTX_ASSIGN_OR_RETURN(ParamState buffers, AllocateParamState(p.info, state.config.moment_dtype));
    const uint64_t count = static_cast<uint64_t>(p.info.count());
    QTX_RETURN_IF_ERROR(ReadFully(fd.get(), buffers.master.get(), count * 4, &crc, path));
    QTX_RETURN_IF_ERROR(ReadFully(fd.get(), buffers.exp_avg.get(), count * mb, &crc, path));
    QTX_RETURN_IF_ERROR(ReadFully(fd.get(), buffers.exp_avg_sq.get(), count * mb, &crc, path));
    p = std::move(buffers);
  }
  QTX_RETURN_IF_ERROR(VerifyChecksum(fd, crc, path));
  return state;
}

namespace {

// INVALID_ARGUMENT unless sources `a` and `b` hold the same configuration
// and parameter table (ranges aside); then FAILED_PRECONDITION unless they
// were written at the same step with the same result.
absl::Status CheckSameGroup(const std::string& pa, const GroupState& a, const std::string& pb,
                            const GroupState& b) {
  auto differ = [&](std::string_view what, const std::string& va, const std::string& vb) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "resharding sources '%s' and '%s' are not checkpoints of one group: %s %s vs %s", pa, pb,
        what, va, vb));
  };
  auto num = [](double v) { return absl::StrFormat("%.17g", v); };
  const GroupConfig& ca = a.config;
  const GroupConfig& cb = b.config;
  const kernels::AdamWHyperParams& ha = ca.hyper;
  const kernels::AdamWHyperParams& hb = cb.hyper;
  if (ha.lr != hb.lr) return differ("lr", num(ha.lr), num(hb.lr));
  if (ha.beta1 != hb.beta1) return differ("beta1", num(ha.beta1), num(hb.beta1));
  if (ha.beta2 != hb.beta2) return differ("beta2", num(ha.beta2), num(hb.beta2));
  if (ha.eps != hb.eps) return differ("eps", num(ha.eps), num(hb.eps));
  if (ha.weight_decay != hb.weight_decay) {
    return differ("weight_decay", num(ha.weight_decay), num(hb.weight_decay));
  }
  if (ha.bias_correction != hb.bias_correction) {
    return differ("bias_correction", absl::StrCat(ha.bias_correction),
                  absl::StrCat(hb.bias_correction));
  }
  if (ca.moment_dtype != cb.moment_dtype) {
    return differ("moment dtype", absl::StrCat(static_cast<int>(ca.moment_dtype)),
                  absl::StrCat(static_cast<int>(cb.moment_dtype)));
  }
  const OutputConfig& oa = ca.output;
  const OutputConfig& ob = cb.output;
  if (oa.fp8 != ob.fp8 || oa.bf16_copy != ob.bf16_copy || oa.quant.scaling != ob.quant.scaling ||
      oa.quant.format != ob.quant.format || oa.quant.rowwise != ob.quant.rowwise ||
      oa.quant.columnwise != ob.quant.columnwise ||
      oa.quant.force_pow2_scales != ob.quant.force_pow2_scales ||
      std::bit_cast<uint32_t>(oa.quant.amax_epsilon) !=
          std::bit_cast<uint32_t>(ob.quant.amax_epsilon)) {
    return differ("output settings", "", "(format, scaling, usages, pow2, amax_epsilon or bf16)");
  }
  if (a.params.size() != b.params.size()) {
    return differ("parameter count", absl::StrCat(a.params.size()), absl::StrCat(b.params.size()));
  }
  for (size_t i = 0; i < a.params.size(); ++i) {
    const ParameterInfo& x = a.params[i].info;
    const ParameterInfo& y = b.params[i].info;
    if (x.name != y.name) {
      return differ(absl::StrFormat("parameters[%d]", i), "'" + x.name + "'", "'" + y.name + "'");
    }
    if (x.shape != y.shape) {
      return differ(absl::StrFormat("the shape of '%s'", x.name),
                    absl::StrCat("[", absl::StrJoin(x.shape, ", "), "]"),
                    absl::StrCat("[", absl::StrJoin(y.shape, ", "), "]"));
    }
    if (!(x.hyper == y.hyper)) {
      return differ(absl::StrFormat("the weight_decay / lr_scale of '%s'", x.name), "", "");
    }
  }
  if (ca.step != cb.step || a.update_count != b.update_count) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "resharding sources '%s' (step %d, %d updates) and '%s' (step %d, %d updates) were "
        "written at different steps: every old owner must checkpoint the same step "
        "(SaveCheckpoint on every owner after the same Step)",
        pa, ca.step, a.update_count, pb, cb.step, b.update_count));
  }
  const StepStats la = a.last.value_or(StepStats{});
  const StepStats lb = b.last.value_or(StepStats{});
  if (a.last.has_value() != b.last.has_value() || la.skipped != lb.skipped ||
      la.clip_coef != lb.clip_coef || la.lr != lb.lr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "resharding sources '%s' and '%s' hold different results of step %d (skipped, clip or "
        "lr differ): they come from different runs",
        pa, pb, ca.step));
  }
  return absl::OkStatus();
}

// Reads `count` elements of `elem` bytes into the checksum, keeping those in
// [keep_begin, keep_end) (element indices relative to the first) at `dst`.
absl::Status ReadKeeping(const Fd& fd, uint64_t count, uint64_t elem, uint64_t keep_begin,
                         uint64_t keep_end, uint8_t* dst, std::vector<uint8_t>& scratch,
                         uint32_t* crc, const std::string& path) {
  auto skip = [&](uint64_t bytes) -> absl::Status {
    while (bytes > 0) {
      const uint64_t n = std::min<uint64_t>(bytes, scratch.size());
      QTX_RETURN_IF_ERROR(ReadFully(fd.get(), scratch.data(), n, crc, path));
      bytes -= n;
    }
    return absl::OkStatus();
  };
  if (keep_begin >= keep_end) return skip(count * elem);
  QTX_RETURN_IF_ERROR(skip(keep_begin * elem));
  QTX_RETURN_IF_ERROR(ReadFully(fd.get(), dst, (keep_end - keep_begin) * elem, crc, path));
  return skip((count - keep_end) * elem);
}

}  // namespace

absl::StatusOr<GroupState> ReadResharded(
    std::span<const std::string> sources, const std::string& name,
    const std::vector<std::pair<std::string, kernels::ElementRange>>& shards,
    const std::function<absl::Status(uint64_t bytes)>& reserve) {
  if (sources.empty()) {
    return absl::InvalidArgumentError(
        "resharding needs the checkpoint of every old owner in `sources` (none given)");
  }
  std::vector<OpenedCheckpoint> opened;
  opened.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (sources[i] == sources[j]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "resharding source '%s' is named twice (sources[%d] and [%d])", sources[i], j, i));
      }
    }
    QTX_ASSIGN_OR_RETURN(OpenedCheckpoint c, OpenCheckpoint(sources[i]));
    if (i > 0) {
      QTX_RETURN_IF_ERROR(CheckSameGroup(sources[0], opened[0].state, sources[i], c.state));
    }
    opened.push_back(std::move(c));
  }
  const GroupState& first = opened[0].state;
  // Every parameter's elements must be in exactly one source.
  for (size_t p = 0; p < first.params.size(); ++p) {
    const ParameterInfo& info = first.params[p].info;
    std::vector<std::pair<kernels::ElementRange, size_t>> pieces;
    for (size_t s = 0; s < opened.size(); ++s) {
      const kernels::ElementRange r = opened[s].state.params[p].info.range();
      if (r.count() > 0) pieces.push_back({r, s});
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const auto& x, const auto& y) { return x.first.begin < y.first.begin; });
    int64_t at = 0;
    size_t prev = 0;
    for (const auto& [r, s] : pieces) {
      if (r.begin < at) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "parameter '%s': elements [%d, %d) are in two sources, '%s' and '%s' (each element "
            "must come from exactly one old owner's checkpoint)",
            info.name, r.begin, std::min(at, r.end), sources[prev], sources[s]));
      }
      if (r.begin > at) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "parameter '%s': elements [%d, %d) of its %d are in no source (is an old owner's "
            "checkpoint missing from `sources`?)",
            info.name, at, r.begin, info.m * info.n));
      }
      at = r.end;
      prev = s;
    }
    if (at != info.m * info.n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter '%s': elements [%d, %d) of its %d are in no source (is an old owner's "
          "checkpoint missing from `sources`?)",
          info.name, at, info.m * info.n, info.m * info.n));
    }
  }
  // The new state: the sources' group with this sidecar's ranges.
  GroupState state;
  state.config = first.config;
  state.config.name = name;
  state.update_count = first.update_count;
  state.last = first.last;
  absl::flat_hash_map<std::string_view, size_t> index;
  for (size_t p = 0; p < first.params.size(); ++p) index[first.params[p].info.name] = p;
  std::vector<std::optional<kernels::ElementRange>> ranges(first.params.size());
  for (const auto& [pname, range] : shards) {
    auto it = index.find(pname);
    if (it == index.end()) {
      std::vector<std::string> names;
      for (const ParamState& ps : first.params) names.push_back(ps.info.name);
      return absl::InvalidArgumentError(absl::StrFormat(
          "shards names parameter '%s', which the sources do not hold (they hold: %s)", pname,
          absl::StrJoin(names, ", ")));
    }
    if (ranges[it->second].has_value()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shards names parameter '%s' twice", pname));
    }
    ranges[it->second] = range;
  }
  int64_t elements = 0;
  for (size_t p = 0; p < first.params.size(); ++p) {
    ParamState ps;
    ps.info = first.params[p].info;
    ps.info.shard = ranges[p];
    state.params.push_back(std::move(ps));
  }
  {
    std::vector<ParameterInfo> infos;
    for (const ParamState& ps : state.params) infos.push_back(ps.info);
    QTX_RETURN_IF_ERROR(ValidateShards(state.config, infos));
  }
  for (const ParamState& ps : state.params) elements += ps.info.count();
  QTX_RETURN_IF_ERROR(reserve(StateBytes(elements, state.config.moment_dtype)));
  for (ParamState& ps : state.params) {
    QTX_ASSIGN_OR_RETURN(ParamState buffers,
                         AllocateParamState(ps.info, state.config.moment_dtype));
    ps = std::move(buffers);
  }
  // Each source from start to end: the checksum covers every byte, and the
  // elements of the new ranges are copied where they belong.
  const uint64_t mb = MomentBytes(state.config.moment_dtype);
  std::vector<uint8_t> scratch(uint64_t{4} << 20);
  for (size_t s = 0; s < opened.size(); ++s) {
    OpenedCheckpoint& c = opened[s];
    for (size_t p = 0; p < state.params.size(); ++p) {
      const kernels::ElementRange src = c.state.params[p].info.range();
      const kernels::ElementRange dst = state.params[p].info.range();
      const int64_t lo = std::max(src.begin, dst.begin);
      const int64_t hi = std::min(src.end, dst.end);
      const uint64_t count = static_cast<uint64_t>(src.count());
      const uint64_t kb = lo < hi ? static_cast<uint64_t>(lo - src.begin) : 0;
      const uint64_t ke = lo < hi ? static_cast<uint64_t>(hi - src.begin) : 0;
      const uint64_t at = lo < hi ? static_cast<uint64_t>(lo - dst.begin) : 0;
      ParamState& t = state.params[p];
      QTX_RETURN_IF_ERROR(ReadKeeping(c.fd, count, 4, kb, ke,
                                      reinterpret_cast<uint8_t*>(t.master.get()) + at * 4, scratch,
                                      &c.crc, sources[s]));
      QTX_RETURN_IF_ERROR(ReadKeeping(c.fd, count, mb, kb, ke, t.exp_avg.get() + at * mb, scratch,
                                      &c.crc, sources[s]));
      QTX_RETURN_IF_ERROR(ReadKeeping(c.fd, count, mb, kb, ke, t.exp_avg_sq.get() + at * mb,
                                      scratch, &c.crc, sources[s]));
    }
    QTX_RETURN_IF_ERROR(VerifyChecksum(c.fd, c.crc, sources[s]));
  }
  return state;
}

absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return Errno("list directory", dir);
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    if (name.find(std::string(kCheckpointSuffix) + ".tmp.") != std::string_view::npos) {
      ::unlinkat(::dirfd(d), e->d_name, 0);  // a write interrupted by a crash
      continue;
    }
    if (name.size() > kCheckpointSuffix.size() && name.ends_with(kCheckpointSuffix)) {
      names.emplace_back(name.substr(0, name.size() - kCheckpointSuffix.size()));
    }
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace qtx::server::optimizer

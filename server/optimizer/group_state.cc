#include "server/optimizer/group_state.h"

#include <cstdint>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace qtx::server::optimizer {

absl::StatusOr<ParamState> AllocateParamState(const ParameterInfo& info,
                                              kernels::MomentDType moment_dtype) {
  ParamState p;
  p.info = info;
  const uint64_t count = static_cast<uint64_t>(info.count());
  const uint64_t mb = MomentBytes(moment_dtype);
  p.master.reset(new (std::nothrow) float[count == 0 ? 1 : count]);
  p.exp_avg.reset(new (std::nothrow) uint8_t[count == 0 ? 1 : count * mb]);
  p.exp_avg_sq.reset(new (std::nothrow) uint8_t[count == 0 ? 1 : count * mb]);
  if (!p.master || !p.exp_avg || !p.exp_avg_sq) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "parameter '%s': cannot allocate %d bytes of host memory for its optimizer state",
        info.name, count * (4 + 2 * mb)));
  }
  return p;
}

}  // namespace qtx::server::optimizer

// qtxd's command-line flags (Abseil flags) and their translation into a
// ServerConfig. Call after absl::ParseCommandLine; one caller at a time.
#ifndef QTX_SERVER_CONFIG_FLAGS_H_
#define QTX_SERVER_CONFIG_FLAGS_H_

#include <string>

#include "server/config/server_config.h"

namespace qtx::server::config {

// Makes Abseil's --help and --helpshort list qtxd's flags (the ones defined
// in this file) and name the file relative to the source tree. Abseil's
// default filter keeps only flags defined in a file named like the program
// (qtxd.cc), so without this --help prints "No flags matched".
// Call before absl::ParseCommandLine.
void InstallFlagsUsageConfig();

// The config named by the flags (not yet validated: see ValidateConfig).
ServerConfig ServerConfigFromFlags();

// --log_level: trace, debug, info, warn, error, off.
std::string LogLevelFromFlags();

}  // namespace qtx::server::config

#endif  // QTX_SERVER_CONFIG_FLAGS_H_

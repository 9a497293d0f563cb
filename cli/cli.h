// The `kvtier` command-line tool. Each command group lives in its own file
// and registers its subcommands on the app; main.cc calls every Register*.
//
// A command's action returns an exit status: 0 success, 1 "not found" (a
// miss), 2 any other failure. Errors are printed as one line on stderr.
#ifndef KVTIER_CLI_CLI_H_
#define KVTIER_CLI_CLI_H_

#include <functional>
#include <string>
#include <string_view>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"

namespace kvtier::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitNotFound = 1;
inline constexpr int kExitError = 2;

// Where a subcommand's action stores its exit status.
struct CommandResult {
  int exit_code = kExitOk;
};

// A cache miss: NotFound with "not found: <what>", marked so that it exits 1.
// Any other error exits 2, a NotFound from a local file (a missing input, an
// output directory that does not exist) included.
absl::Status CacheMiss(std::string_view what);
bool IsCacheMiss(const absl::Status& status);

// Prints "kvtier: <message>" on stderr and returns the exit code for `status`
// (1 for a CacheMiss, 2 otherwise). REQUIRES: !status.ok().
int ReportError(const absl::Status& status);

// Wraps a command body so its Status becomes an exit code.
std::function<void()> Action(CommandResult& result, std::function<absl::Status()> body);

void RegisterCodecCommands(CLI::App& app, CommandResult& result);
void RegisterDaemonCommands(CLI::App& app, CommandResult& result);
void RegisterBandwidthCommands(CLI::App& app, CommandResult& result);
void RegisterClusterCommands(CLI::App& app, CommandResult& result);
void RegisterReplayCommands(CLI::App& app, CommandResult& result);

}  // namespace kvtier::cli

#endif  // KVTIER_CLI_CLI_H_

#include "client/cli.h"

#include <cstdio>
#include <string>

namespace kvtier::cli {

int ReportError(const absl::Status& status) {
  std::string msg(status.message());
  for (char& c : msg) {
    if (c == '\n') c = ' ';
  }
  std::fprintf(stderr, "kvtier: %s\n", msg.c_str());
  return status.code() == absl::StatusCode::kNotFound ? kExitNotFound : kExitError;
}

std::function<void()> Action(CommandResult& result, std::function<absl::Status()> body) {
  return [&result, body = std::move(body)]() {
    absl::Status s = body();
    result.exit_code = s.ok() ? kExitOk : ReportError(s);
  };
}

}  // namespace kvtier::cli

#include "cli/cli.h"

#include <cstdio>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/strings.h"

namespace kvtier::cli {

namespace {
constexpr std::string_view kCacheMissPayload = "kvtier.dev/cache-miss";
}  // namespace

absl::Status CacheMiss(std::string_view what) {
  absl::Status st = absl::NotFoundError(absl::StrCat("not found: ", AsAbsl(what)));
  st.SetPayload(AsAbsl(kCacheMissPayload), absl::Cord("1"));
  return st;
}

bool IsCacheMiss(const absl::Status& status) {
  return absl::IsNotFound(status) && status.GetPayload(AsAbsl(kCacheMissPayload)).has_value();
}

int ReportError(const absl::Status& status) {
  std::string msg(status.message());
  for (char& c : msg) {
    if (c == '\n') c = ' ';
  }
  std::fprintf(stderr, "kvtier: %s\n", msg.c_str());
  return IsCacheMiss(status) ? kExitNotFound : kExitError;
}

std::function<void()> Action(CommandResult& result, std::function<absl::Status()> body) {
  return [&result, body = std::move(body)]() {
    absl::Status s = body();
    result.exit_code = s.ok() ? kExitOk : ReportError(s);
  };
}

}  // namespace kvtier::cli

// Debian's Abseil 20220623 is built with ABSL_OPTION_USE_STD_STRING_VIEW 0:
// absl::string_view is its own type and absl::StrCat does not take a
// std::string_view. AsAbsl bridges the two without copying.
#ifndef KVTIER_COMMON_STRINGS_H_
#define KVTIER_COMMON_STRINGS_H_

#include <string_view>

#include "absl/strings/string_view.h"

namespace kvtier {

inline absl::string_view AsAbsl(std::string_view s) { return {s.data(), s.size()}; }
inline std::string_view AsStd(absl::string_view s) { return {s.data(), s.size()}; }

}  // namespace kvtier

#endif  // KVTIER_COMMON_STRINGS_H_

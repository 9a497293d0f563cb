#include "cli/npy.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/strings.h"

namespace kvtier::npy {
namespace {

constexpr uint8_t kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr uint64_t kMaxElements = uint64_t{1} << 36;

absl::Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("npy: ", AsAbsl(what)));
}

void SkipSpaces(std::string_view s, size_t& i) {
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n')) ++i;
}

// Finds `'key':` in the header dict and returns the index after the colon.
absl::StatusOr<size_t> FindKey(std::string_view header, std::string_view key) {
  std::string quoted1 = absl::StrCat("'", AsAbsl(key), "'");
  std::string quoted2 = absl::StrCat("\"", AsAbsl(key), "\"");
  size_t pos = header.find(quoted1);
  size_t len = quoted1.size();
  if (pos == std::string_view::npos) {
    pos = header.find(quoted2);
    len = quoted2.size();
  }
  if (pos == std::string_view::npos) return Bad(absl::StrCat("header has no '", AsAbsl(key), "'"));
  size_t i = pos + len;
  SkipSpaces(header, i);
  if (i >= header.size() || header[i] != ':') return Bad(absl::StrCat("header: no ':' after ", AsAbsl(key)));
  ++i;
  SkipSpaces(header, i);
  return i;
}

absl::StatusOr<std::string> ParseQuoted(std::string_view header, size_t i) {
  if (i >= header.size() || (header[i] != '\'' && header[i] != '"')) return Bad("header: descr is not a string");
  char q = header[i];
  size_t end = header.find(q, i + 1);
  if (end == std::string_view::npos || end - i > 32) return Bad("header: unterminated descr");
  return std::string(header.substr(i + 1, end - i - 1));
}

absl::StatusOr<std::vector<uint64_t>> ParseShape(std::string_view header, size_t i) {
  if (i >= header.size() || header[i] != '(') return Bad("header: shape is not a tuple");
  ++i;
  std::vector<uint64_t> shape;
  while (true) {
    SkipSpaces(header, i);
    if (i >= header.size()) return Bad("header: unterminated shape");
    if (header[i] == ')') break;
    uint64_t v = 0;
    size_t digits = 0;
    while (i < header.size() && header[i] >= '0' && header[i] <= '9') {
      if (++digits > 12) return Bad("header: shape dimension too large");
      v = v * 10 + static_cast<uint64_t>(header[i] - '0');
      ++i;
    }
    if (digits == 0) return Bad("header: shape holds a non-integer");
    if (shape.size() >= 8) return Bad("header: more than 8 dimensions");
    shape.push_back(v);
    SkipSpaces(header, i);
    if (i < header.size() && header[i] == ',') ++i;
  }
  return shape;
}

}  // namespace

absl::StatusOr<Array16> Parse(std::span<const uint8_t> file) {
  if (file.size() < 10) return Bad("file shorter than the 10-byte preamble");
  if (std::memcmp(file.data(), kMagic, sizeof(kMagic)) != 0) return Bad("bad magic (not a .npy file)");
  uint8_t major = file[6];
  size_t header_len;
  size_t header_start;
  if (major == 1) {
    header_len = file[8] | (size_t{file[9]} << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (file.size() < 12) return Bad("file shorter than the 12-byte preamble");
    header_len = file[8] | (size_t{file[9]} << 8) | (size_t{file[10]} << 16) | (size_t{file[11]} << 24);
    header_start = 12;
  } else {
    return Bad(absl::StrCat("version ", major, " is not supported"));
  }
  if (header_len > kMaxHeaderBytes) return Bad("header is larger than 64 KiB");
  if (file.size() - header_start < header_len) return Bad("truncated header");
  std::string_view header(reinterpret_cast<const char*>(file.data() + header_start), header_len);

  Array16 out;
  auto di = FindKey(header, "descr");
  if (!di.ok()) return di.status();
  auto descr = ParseQuoted(header, *di);
  if (!descr.ok()) return descr.status();
  if (*descr == "=f2") *descr = "<f2";
  if (*descr == "=u2") *descr = "<u2";
  if (*descr != "<f2" && *descr != "<u2") {
    return Bad(absl::StrCat("dtype '", *descr, "' is not supported (want float16 '<f2' or uint16 '<u2')"));
  }
  out.descr = *descr;
  auto fi = FindKey(header, "fortran_order");
  if (!fi.ok()) return fi.status();
  if (header.substr(*fi, 5) != "False") return Bad("fortran_order arrays are not supported");
  auto si = FindKey(header, "shape");
  if (!si.ok()) return si.status();
  auto shape = ParseShape(header, *si);
  if (!shape.ok()) return shape.status();
  out.shape = *shape;
  uint64_t elements = 1;
  for (uint64_t d : out.shape) {
    if (d != 0 && elements > kMaxElements / d) return Bad("shape has too many elements");
    elements *= d;
  }
  if (elements > kMaxElements) return Bad("shape has too many elements");
  size_t payload = file.size() - header_start - header_len;
  if (payload != elements * 2) {
    return Bad(absl::StrCat("payload is ", payload, " bytes, shape (",
                            absl::StrJoin(out.shape, ", "), ") needs ", elements * 2));
  }
  out.data.resize(elements);
  std::memcpy(out.data.data(), file.data() + header_start + header_len, payload);
  return out;
}

std::vector<uint8_t> Serialize(const Array16& array) {
  std::string shape = absl::StrJoin(array.shape, ", ");
  if (array.shape.size() == 1) shape += ",";
  std::string header = absl::StrCat("{'descr': '", array.descr, "', 'fortran_order': False, 'shape': (",
                                    shape, "), }");
  // Pad with spaces so that preamble + header + '\n' is a multiple of 64.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::vector<uint8_t> out;
  out.reserve(10 + header.size() + array.data.size() * 2);
  out.insert(out.end(), kMagic, kMagic + sizeof(kMagic));
  out.push_back(1);
  out.push_back(0);
  out.push_back(static_cast<uint8_t>(header.size() & 0xFF));
  out.push_back(static_cast<uint8_t>(header.size() >> 8));
  out.insert(out.end(), header.begin(), header.end());
  const uint8_t* p = reinterpret_cast<const uint8_t*>(array.data.data());
  out.insert(out.end(), p, p + array.data.size() * 2);
  return out;
}

}  // namespace kvtier::npy

#include "bandwidth/links.h"

#include <cmath>
#include <cstdlib>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file.h"
#include "common/status.h"
#include "common/strings.h"
#include "nlohmann/json.hpp"

namespace kvtier::bandwidth {
namespace {

using Json = nlohmann::json;

constexpr char kLinksFormat[] = "kvtier-links-v1";
constexpr uint64_t kMaxLinksFileBytes = 1 << 20;

const std::vector<Link>& Presets() {
  static const std::vector<Link>* const links = new std::vector<Link>{
      {"hbm3", 3350, "HBM3, H100 SXM device memory"},
      {"hbm3e", 4800, "HBM3e, H200 device memory"},
      {"nvlink4", 900, "NVLink 4, H100/H200 GPU-to-GPU, total of both directions"},
      {"pcie4", 32, "PCIe 4.0 x16, one direction"},
      {"pcie5", 64, "PCIe 5.0 x16, one direction"},
      {"cxl2", 32, "CXL 2.0 memory expander on a PCIe 5.0 x8 link"},
      {"400gbe", 50, "400 Gb/s Ethernet or InfiniBand NDR NIC"},
      {"nvme-gen4", 7, "NVMe SSD on PCIe 4.0 x4, sequential read"},
      {"nvme-gen5", 14, "NVMe SSD on PCIe 5.0 x4, sequential read"},
  };
  return *links;
}

bool ValidName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' &&
        c != '.' && c != '+' && c != '/') {
      return false;
    }
  }
  return true;
}

absl::Status CheckLink(const Link& link) {
  if (!ValidName(link.name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad link name '", link.name, "' (letters, digits, - _ . + / only, at most 64)"));
  }
  if (!(link.gb_per_s > 0) || !std::isfinite(link.gb_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat("link '", link.name,
                                                   "': bandwidth must be a positive number of "
                                                   "GB/s, got ",
                                                   link.gb_per_s));
  }
  return absl::OkStatus();
}

}  // namespace

std::span<const Link> LinkPresets() { return Presets(); }

absl::StatusOr<Link> ParseLink(std::string_view spec) {
  const size_t eq = spec.find('=');
  if (eq == std::string_view::npos) {
    for (const Link& l : Presets()) {
      if (absl::EqualsIgnoreCase(AsAbsl(spec), l.name)) return l;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown link '", AsAbsl(spec), "' (see `kvtier links`, or give name=GB/s)"));
  }
  Link link;
  link.name = std::string(spec.substr(0, eq));
  const std::string_view number = spec.substr(eq + 1);
  if (!absl::SimpleAtod(AsAbsl(number), &link.gb_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat("link '", AsAbsl(spec),
                                                   "': '", AsAbsl(number),
                                                   "' is not a number of GB/s"));
  }
  link.description = "custom";
  KVTIER_RETURN_IF_ERROR(CheckLink(link));
  return link;
}

absl::StatusOr<std::vector<Link>> ParseLinkList(std::string_view specs) {
  std::vector<Link> out;
  absl::flat_hash_set<std::string> seen;
  for (absl::string_view part : absl::StrSplit(AsAbsl(specs), ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("empty link in '", AsAbsl(specs), "'"));
    }
    KVTIER_ASSIGN_OR_RETURN(Link link, ParseLink(AsStd(part)));
    if (!seen.insert(link.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("link '", link.name, "' given twice"));
    }
    out.push_back(std::move(link));
  }
  return out;
}

std::string LinksToJson(std::span<const Link> links) {
  Json arr = Json::array();
  for (const Link& l : links) {
    arr.push_back({{"name", l.name}, {"gb_per_s", l.gb_per_s}, {"description", l.description}});
  }
  Json root = {{"format", kLinksFormat},
               {"units", "decimal GB/s (1 GB/s = 1e9 bytes/s)"},
               {"links", std::move(arr)}};
  return root.dump(2) + "\n";
}

absl::StatusOr<std::vector<Link>> ParseLinksJson(std::string_view json_text) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError("links file is not a JSON object");
  }
  auto format = root.find("format");
  if (format == root.end() || !format->is_string() ||
      format->get<std::string>() != kLinksFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("links file: \"format\" must be \"", kLinksFormat, "\""));
  }
  auto links = root.find("links");
  if (links == root.end() || !links->is_array()) {
    return absl::InvalidArgumentError("links file: \"links\" must be an array");
  }
  std::vector<Link> out;
  for (const Json& item : *links) {
    if (!item.is_object() || !item.contains("name") || !item["name"].is_string() ||
        !item.contains("gb_per_s") || !item["gb_per_s"].is_number()) {
      return absl::InvalidArgumentError(
          "links file: every link needs a string \"name\" and a number \"gb_per_s\"");
    }
    Link l;
    l.name = item["name"].get<std::string>();
    l.gb_per_s = item["gb_per_s"].get<double>();
    if (auto d = item.find("description"); d != item.end() && d->is_string()) {
      l.description = d->get<std::string>();
    }
    KVTIER_RETURN_IF_ERROR(CheckLink(l));
    out.push_back(std::move(l));
  }
  if (out.empty()) return absl::InvalidArgumentError("links file holds no links");
  return out;
}

absl::StatusOr<std::vector<Link>> LoadLinksFile(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path, kMaxLinksFileBytes));
  absl::StatusOr<std::vector<Link>> links = ParseLinksJson(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  if (!links.ok()) {
    return absl::Status(links.status().code(),
                        absl::StrCat(path, ": ", links.status().message()));
  }
  return links;
}

absl::Status SaveLinksFile(const std::string& path, std::span<const Link> links) {
  const std::string text = LinksToJson(links);
  return WriteFileAtomic(path, std::span<const uint8_t>(
                                   reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace kvtier::bandwidth

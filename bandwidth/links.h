// Links (the paths KV travels over) and their bandwidths: presets, custom
// `name=GB/s` specs, and the JSON file that `kvtier probe --save` writes.
// Bandwidths are decimal GB/s (1 GB/s = 1e9 bytes/s).
#ifndef KVTIER_BANDWIDTH_LINKS_H_
#define KVTIER_BANDWIDTH_LINKS_H_

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::bandwidth {

struct Link {
  std::string name;         // short key: "pcie5", "hbm3e", "dram-memcpy", ...
  double gb_per_s = 0;      // decimal GB/s, one direction
  std::string description;  // what it is, for `kvtier links`
  double bytes_per_s() const { return gb_per_s * 1e9; }
};

// The built-in links, in display order: hbm3 3350, hbm3e 4800, nvlink4 900,
// pcie4 32, pcie5 64, cxl2 32, 400gbe 50, nvme-gen4 7, nvme-gen5 14 (GB/s).
std::span<const Link> LinkPresets();

// Parses one link: a preset name (any case) or `name=GB/s` with a name of
// letters, digits, '-', '_', '.', '+', '/' and a positive finite number.
// InvalidArgument otherwise (unknown preset, malformed or non-positive number).
absl::StatusOr<Link> ParseLink(std::string_view spec);

// Parses a comma-separated list of ParseLink specs. InvalidArgument for an
// empty list, any bad element, or a name given twice.
absl::StatusOr<std::vector<Link>> ParseLinkList(std::string_view specs);

// The links file: {"format": "kvtier-links-v1", "units": "decimal GB/s
// (1e9 bytes/s)", "links": [{"name": ..., "gb_per_s": ..., "description": ...}]}.
std::string LinksToJson(std::span<const Link> links);
// InvalidArgument for malformed JSON, a wrong "format", or a bad link.
absl::StatusOr<std::vector<Link>> ParseLinksJson(std::string_view json_text);
// Reads a links file. NotFound when it is missing; else as ParseLinksJson.
absl::StatusOr<std::vector<Link>> LoadLinksFile(const std::string& path);
// Writes a links file atomically.
absl::Status SaveLinksFile(const std::string& path, std::span<const Link> links);

}  // namespace kvtier::bandwidth

#endif  // KVTIER_BANDWIDTH_LINKS_H_

// Built-in model presets, taken from each model's Hugging Face config.json.
// Thread-safe: the table is immutable.
#ifndef KVTIER_BANDWIDTH_PRESETS_H_
#define KVTIER_BANDWIDTH_PRESETS_H_

#include <span>
#include <string_view>

#include "absl/status/statusor.h"
#include "bandwidth/model.h"

namespace kvtier::bandwidth {

struct ModelPreset {
  ModelSpec spec;           // spec.param_count is the published count
  const char* hf_repo;      // the Hugging Face repository the numbers come from
};

// Every preset, in display order.
std::span<const ModelPreset> ModelPresets();

// The preset whose name or Hugging Face repository equals `name`, ignoring
// case ("llama-3.1-70b", "meta-llama/Llama-3.1-70B"). NotFound otherwise.
absl::StatusOr<ModelSpec> FindModelPreset(std::string_view name);

}  // namespace kvtier::bandwidth

#endif  // KVTIER_BANDWIDTH_PRESETS_H_

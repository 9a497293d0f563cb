#include "bandwidth/presets.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/strings.h"

namespace kvtier::bandwidth {
namespace {

struct Row {
  const char* name;
  const char* hf_repo;
  uint32_t layers, kv_heads, head_dim;
  uint64_t params;  // published parameter count (safetensors total)
  uint64_t hidden, heads, intermediate, vocab;
  bool qkv_bias;
};

// Numbers from each repository's config.json (num_hidden_layers,
// num_key_value_heads, head_dim or hidden_size / num_attention_heads,
// intermediate_size, vocab_size); every one is torch_dtype bfloat16 with
// untied embeddings. Qwen2 models carry q/k/v biases.
constexpr Row kRows[] = {
    {"Qwen2.5-7B", "Qwen/Qwen2.5-7B", 28, 4, 128, 7'615'616'512, 3584, 28, 18944, 152064, true},
    {"Qwen2.5-72B", "Qwen/Qwen2.5-72B", 80, 8, 128, 72'706'203'648, 8192, 64, 29568, 152064,
     true},
    {"Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 32, 8, 128, 8'030'261'248, 4096, 32, 14336,
     128256, false},
    {"Llama-3.1-70B", "meta-llama/Llama-3.1-70B", 80, 8, 128, 70'553'706'496, 8192, 64, 28672,
     128256, false},
    {"Mistral-7B", "mistralai/Mistral-7B-v0.3", 32, 8, 128, 7'248'023'552, 4096, 32, 14336,
     32768, false},
    {"Mistral-Small-24B", "mistralai/Mistral-Small-24B-Base-2501", 40, 8, 128, 23'572'403'200,
     5120, 32, 32768, 131072, false},
    {"Phi-4-14B", "microsoft/phi-4", 40, 10, 128, 14'659'507'200, 5120, 40, 17920, 100352,
     false},
};

std::vector<ModelPreset> BuildPresets() {
  std::vector<ModelPreset> out;
  for (const Row& r : kRows) {
    ModelPreset p;
    p.hf_repo = r.hf_repo;
    p.spec.name = r.name;
    p.spec.num_layers = r.layers;
    p.spec.num_kv_heads = r.kv_heads;
    p.spec.head_dim = r.head_dim;
    p.spec.param_count = r.params;
    p.spec.weight_bytes_per_param = 2.0;
    p.spec.weight_dtype = "bfloat16";
    p.spec.kv_dtype = codec::DType::kBF16;
    p.spec.arch.hidden_size = r.hidden;
    p.spec.arch.num_attention_heads = r.heads;
    p.spec.arch.intermediate_size = r.intermediate;
    p.spec.arch.vocab_size = r.vocab;
    p.spec.arch.tie_word_embeddings = false;
    p.spec.arch.qkv_bias = r.qkv_bias;
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

std::span<const ModelPreset> ModelPresets() {
  static const std::vector<ModelPreset>* const presets =
      new std::vector<ModelPreset>(BuildPresets());
  return *presets;
}

absl::StatusOr<ModelSpec> FindModelPreset(std::string_view name) {
  for (const ModelPreset& p : ModelPresets()) {
    if (absl::EqualsIgnoreCase(AsAbsl(name), p.spec.name) ||
        absl::EqualsIgnoreCase(AsAbsl(name), p.hf_repo)) {
      return p.spec;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("unknown model '", AsAbsl(name), "' (see `kvtier models`)"));
}

}  // namespace kvtier::bandwidth

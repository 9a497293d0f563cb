#include "bandwidth/hf_config.h"

#include <filesystem>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "common/strings.h"
#include "nlohmann/json.hpp"

namespace kvtier::bandwidth {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxConfigBytes = 16 << 20;  // config.json files are a few KiB

// A positive integer field; nullopt when absent (or null).
absl::StatusOr<std::optional<uint64_t>> PositiveInt(const Json& obj, const char* field,
                                                    const std::string& name) {
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return std::optional<uint64_t>();
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json of '", name, "': ", field, " must be an integer"));
  }
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (v > 0) return std::optional<uint64_t>(v);
  }
  return absl::InvalidArgumentError(absl::StrCat("config.json of '", name, "': ", field,
                                                 " must be positive, got ", it->dump()));
}

absl::StatusOr<uint64_t> RequiredInt(const Json& obj, const char* field, const std::string& name) {
  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> v, PositiveInt(obj, field, name));
  if (!v) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json of '", name, "': missing ", field));
  }
  return *v;
}

absl::StatusOr<bool> Bool(const Json& obj, const char* field, bool fallback,
                          const std::string& name) {
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json of '", name, "': ", field, " must be true or false"));
  }
  return it->get<bool>();
}

absl::Status ApplyDtype(const Json& obj, ModelSpec& spec) {
  auto it = obj.find("torch_dtype");
  if (it == obj.end() || it->is_null()) it = obj.find("dtype");
  if (it == obj.end() || it->is_null()) return absl::OkStatus();  // keep bfloat16
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json of '", spec.name, "': torch_dtype must be a string"));
  }
  const std::string d = it->get<std::string>();
  if (d == "bfloat16") {
    spec.weight_bytes_per_param = 2;
    spec.kv_dtype = codec::DType::kBF16;
  } else if (d == "float16") {
    spec.weight_bytes_per_param = 2;
    spec.kv_dtype = codec::DType::kFP16;
  } else if (d == "float32") {
    spec.weight_bytes_per_param = 4;
    spec.kv_dtype = codec::DType::kBF16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json of '", spec.name, "': unsupported torch_dtype '", d,
        "' (want bfloat16, float16 or float32)"));
  }
  spec.weight_dtype = d;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelSpec> ParseHfConfig(std::string_view json_text, std::string name,
                                        bool allow_unknown_params) {
  Json root;
  try {
    root = Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json of '", name, "' is not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json of '", name, "' is not a JSON object"));
  }
  const Json* cfg = &root;
  if (!root.contains("num_hidden_layers") && root.contains("text_config") &&
      root["text_config"].is_object()) {
    cfg = &root["text_config"];
  }

  ModelSpec spec;
  spec.name = std::move(name);
  const std::string& n = spec.name;
  KVTIER_ASSIGN_OR_RETURN(uint64_t layers, RequiredInt(*cfg, "num_hidden_layers", n));
  KVTIER_ASSIGN_OR_RETURN(uint64_t heads, RequiredInt(*cfg, "num_attention_heads", n));
  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> kv_heads,
                          PositiveInt(*cfg, "num_key_value_heads", n));
  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> head_dim, PositiveInt(*cfg, "head_dim", n));
  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> hidden, PositiveInt(*cfg, "hidden_size", n));
  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> inter,
                          PositiveInt(*cfg, "intermediate_size", n));
  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> vocab, PositiveInt(*cfg, "vocab_size", n));
  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> experts,
                          PositiveInt(*cfg, "num_local_experts", n));
  if (!experts) {
    KVTIER_ASSIGN_OR_RETURN(experts, PositiveInt(*cfg, "num_experts", n));
  }

  if (!head_dim) {
    if (!hidden) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json of '", n, "': missing head_dim and hidden_size"));
    }
    if (*hidden % heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json of '", n, "': hidden_size ", *hidden,
                       " is not a multiple of num_attention_heads ", heads));
    }
    head_dim = *hidden / heads;
  }
  if (!kv_heads) kv_heads = heads;
  if (*kv_heads > heads || heads % *kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json of '", n, "': num_attention_heads ", heads,
                     " is not a multiple of num_key_value_heads ", *kv_heads));
  }
  auto limit = [&](const char* field, uint64_t v, uint64_t max) -> absl::Status {
    if (v > max) {
      return absl::InvalidArgumentError(absl::StrCat("config.json of '", n, "': ", field, " = ",
                                                     v, " is above the limit ", max));
    }
    return absl::OkStatus();
  };
  KVTIER_RETURN_IF_ERROR(limit("num_hidden_layers", layers, codec::kMaxLayers));
  KVTIER_RETURN_IF_ERROR(limit("num_key_value_heads", *kv_heads, codec::kMaxKvHeads));
  KVTIER_RETURN_IF_ERROR(limit("head_dim", *head_dim, codec::kMaxHeadDim));
  spec.num_layers = static_cast<uint32_t>(layers);
  spec.num_kv_heads = static_cast<uint32_t>(*kv_heads);
  spec.head_dim = static_cast<uint32_t>(*head_dim);
  KVTIER_RETURN_IF_ERROR(ApplyDtype(*cfg, spec));
  if (cfg != &root && !cfg->contains("torch_dtype") && !cfg->contains("dtype")) {
    KVTIER_RETURN_IF_ERROR(ApplyDtype(root, spec));
  }

  Architecture& a = spec.arch;
  a.hidden_size = hidden.value_or(0);
  a.num_attention_heads = heads;
  a.intermediate_size = inter.value_or(0);
  a.vocab_size = vocab.value_or(0);
  a.num_experts = experts.value_or(1);
  KVTIER_ASSIGN_OR_RETURN(a.tie_word_embeddings, Bool(*cfg, "tie_word_embeddings", false, n));
  if (cfg != &root && !cfg->contains("tie_word_embeddings")) {
    KVTIER_ASSIGN_OR_RETURN(a.tie_word_embeddings, Bool(root, "tie_word_embeddings", false, n));
  }
  KVTIER_ASSIGN_OR_RETURN(bool attention_bias, Bool(*cfg, "attention_bias", false, n));
  KVTIER_ASSIGN_OR_RETURN(a.mlp_bias, Bool(*cfg, "mlp_bias", false, n));
  std::string model_type;
  if (auto it = cfg->find("model_type"); it != cfg->end() && it->is_string()) {
    model_type = it->get<std::string>();
  }
  // Qwen2's attention has q/k/v biases and no attention_bias field; Llama's
  // attention_bias puts a bias on all four projections.
  a.qkv_bias = attention_bias || absl::StartsWith(model_type, "qwen2");
  a.o_bias = attention_bias;

  KVTIER_ASSIGN_OR_RETURN(std::optional<uint64_t> published,
                          PositiveInt(root, "num_parameters", n));
  if (published) {
    spec.param_count = *published;
  } else {
    absl::StatusOr<uint64_t> estimate = EstimateParamCount(spec);
    if (estimate.ok()) {
      spec.param_count = *estimate;
    } else if (!allow_unknown_params) {
      return absl::InvalidArgumentError(
          absl::StrCat(estimate.status().message(), " (give the count with --params)"));
    }
  }
  return spec;
}

absl::StatusOr<ModelSpec> LoadHfConfig(const std::string& path, bool allow_unknown_params) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path, kMaxConfigBytes));
  std::filesystem::path p(path);
  std::string name = p.stem().string();
  const std::string dir = p.parent_path().filename().string();
  if (name == "config" && !dir.empty() && dir != "." && dir != "..") name = dir;
  return ParseHfConfig(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
      std::move(name), allow_unknown_params);
}

}  // namespace kvtier::bandwidth

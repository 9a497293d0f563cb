#include "bandwidth/model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvtier::bandwidth {

absl::Status ValidateModel(const ModelSpec& model) {
  auto check = [&](const char* field, uint64_t value, uint64_t max) -> absl::Status {
    if (value == 0 || value > max) {
      return absl::InvalidArgumentError(absl::StrCat("model '", model.name, "': ", field, " = ",
                                                     value, " is outside [1, ", max, "]"));
    }
    return absl::OkStatus();
  };
  KVTIER_RETURN_IF_ERROR(check("num_layers", model.num_layers, codec::kMaxLayers));
  KVTIER_RETURN_IF_ERROR(check("num_kv_heads", model.num_kv_heads, codec::kMaxKvHeads));
  KVTIER_RETURN_IF_ERROR(check("head_dim", model.head_dim, codec::kMaxHeadDim));
  if (model.param_count == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", model.name, "': param_count must be positive"));
  }
  if (!(model.weight_bytes_per_param > 0) || !std::isfinite(model.weight_bytes_per_param)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", model.name, "': weight bytes per parameter must be positive"));
  }
  if (model.kv_dtype != codec::DType::kFP16 && model.kv_dtype != codec::DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", model.name, "': the KV dtype must be fp16 or bf16"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> EstimateParamCount(const ModelSpec& model) {
  const Architecture& a = model.arch;
  auto need = [&](const char* field, uint64_t value) -> absl::Status {
    if (value == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", model.name, "': cannot estimate the parameter count without ", field));
    }
    return absl::OkStatus();
  };
  KVTIER_RETURN_IF_ERROR(need("num_hidden_layers", model.num_layers));
  KVTIER_RETURN_IF_ERROR(need("num_key_value_heads", model.num_kv_heads));
  KVTIER_RETURN_IF_ERROR(need("head_dim", model.head_dim));
  KVTIER_RETURN_IF_ERROR(need("hidden_size", a.hidden_size));
  KVTIER_RETURN_IF_ERROR(need("num_attention_heads", a.num_attention_heads));
  KVTIER_RETURN_IF_ERROR(need("intermediate_size", a.intermediate_size));
  KVTIER_RETURN_IF_ERROR(need("vocab_size", a.vocab_size));
  KVTIER_RETURN_IF_ERROR(need("num_experts", a.num_experts));

  const uint64_t h = a.hidden_size;
  const uint64_t q_width = a.num_attention_heads * model.head_dim;
  const uint64_t kv_width = uint64_t{model.num_kv_heads} * model.head_dim;
  uint64_t attention = 2 * q_width * h + 2 * kv_width * h;  // q, o + k, v
  if (a.qkv_bias) attention += q_width + 2 * kv_width;
  if (a.o_bias) attention += h;
  uint64_t mlp = a.num_experts * 3 * h * a.intermediate_size;
  if (a.mlp_bias) mlp += a.num_experts * (2 * a.intermediate_size + h);
  if (a.num_experts > 1) mlp += h * a.num_experts;  // router
  const uint64_t norms = 2 * h;
  const uint64_t per_layer = attention + mlp + norms;

  const uint64_t embeddings = a.vocab_size * h;
  const uint64_t lm_head = a.tie_word_embeddings ? 0 : a.vocab_size * h;
  return embeddings + per_layer * model.num_layers + h + lm_head;
}

absl::StatusOr<double> KvBytesPerToken(const ModelSpec& model, const codec::CodecFormat& codec,
                                       const ChunkingOptions& chunking) {
  codec::Geometry g;
  g.num_layers = model.num_layers;
  g.num_kv_heads = model.num_kv_heads;
  g.head_dim = model.head_dim;
  g.num_tokens = chunking.chunk_tokens;
  g.block_size = chunking.block_size;
  return codec::BytesPerToken(g, codec.k, codec.v);
}

double StepKvBytes(double bytes_per_token, uint64_t context, uint64_t batch) {
  return static_cast<double>(batch) * static_cast<double>(context) * bytes_per_token;
}

double WeightBytes(const ModelSpec& model) {
  return static_cast<double>(model.param_count) * model.weight_bytes_per_param;
}

double RequiredBandwidth(double bytes, double latency_s) { return bytes / latency_s; }

double Shortfall(double required_bytes_per_s, double link_bytes_per_s) {
  return required_bytes_per_s / link_bytes_per_s;
}

double LoadMicros(uint64_t bytes, double bytes_per_s, double latency_us) {
  return latency_us + static_cast<double>(bytes) * 1e6 / bytes_per_s;
}

double RecomputeMicros(uint64_t first_token, uint64_t tokens, const PrefillCost& prefill) {
  if (!(prefill.tokens_per_s > 0)) return 0.0;
  const double linear = static_cast<double>(tokens) * 1e6 / prefill.tokens_per_s;
  if (prefill.attention_doubling_tokens == 0) return linear;
  // Position c costs (1 + c / C2) / r; the mean position of the range is a + n/2.
  const double mean_context = static_cast<double>(first_token) + static_cast<double>(tokens) / 2;
  return linear * (1 + mean_context / prefill.attention_doubling_tokens);
}

std::vector<double> ChunkRecomputeMicros(size_t chunks, uint32_t tokens_per_chunk,
                                         const PrefillCost& prefill) {
  std::vector<double> out(chunks);
  for (size_t i = 0; i < chunks; ++i) {
    out[i] = RecomputeMicros(uint64_t{i} * tokens_per_chunk, tokens_per_chunk, prefill);
  }
  return out;
}

LoadDecision BestLoadPrefix(std::span<const double> load_us, std::span<const double> recompute_us) {
  LoadDecision best;
  double load = 0, recompute = 0;
  const size_t n = std::min(load_us.size(), recompute_us.size());
  for (size_t i = 0; i < n; ++i) {
    load += load_us[i];
    recompute += recompute_us[i];
    if (recompute - load > best.saved_us()) best = {i + 1, load, recompute};
  }
  return best;
}

double KvFraction(double kv_bytes, double weight_bytes) {
  const double total = kv_bytes + weight_bytes;
  return total > 0 ? kv_bytes / total : 0.0;
}

double CodecSpeedupBound(double f, double c) { return 1.0 / (f * c + (1.0 - f)); }

absl::Status ValidateHill(const HillCurve& hill) {
  auto positive = [](const char* field, double v) -> absl::Status {
    if (!(v > 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Hill curve: ", field, " must be positive and finite, got ", v));
    }
    return absl::OkStatus();
  };
  KVTIER_RETURN_IF_ERROR(positive("Smax", hill.s_max));
  KVTIER_RETURN_IF_ERROR(positive("Bh", hill.b_half));
  KVTIER_RETURN_IF_ERROR(positive("g", hill.g));
  return absl::OkStatus();
}

double HillSaturation(const HillCurve& hill, double batch) {
  const double bg = std::pow(batch, hill.g);
  return hill.s_max * bg / (std::pow(hill.b_half, hill.g) + bg);
}

}  // namespace kvtier::bandwidth

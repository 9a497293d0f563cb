// The bandwidth model: how many bytes a decode step streams from the KV
// cache, how fast a link must be to stream them within a latency target, and
// by how much each link falls short. The placement engine uses it to decide
// what must stay close to the GPU; `kvtier shortfall` prints it.
//
// Units, everywhere in this library:
//   sizes       bytes (double where a product may exceed 2^53 only in theory)
//   time        seconds
//   bandwidth   bytes per second; the CLI prints decimal GB/s (1e9 B/s) and
//               TB/s (1e12 B/s), never GiB.
//
// docs/bandwidth-model.md has the formulas with a worked example.
// Every function here is pure and thread-safe.
#ifndef KVTIER_BANDWIDTH_MODEL_H_
#define KVTIER_BANDWIDTH_MODEL_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "codec/format.h"

namespace kvtier::bandwidth {

inline constexpr double kBytesPerGB = 1e9;  // decimal gigabyte
inline constexpr double kBytesPerTB = 1e12;  // decimal terabyte

// The transformer shape that the parameter-count estimate needs. Zero fields
// mean "unknown" (a preset or config that gives the parameter count directly
// does not need them).
struct Architecture {
  uint64_t hidden_size = 0;
  uint64_t num_attention_heads = 0;
  uint64_t intermediate_size = 0;  // per expert for mixture-of-experts models
  uint64_t vocab_size = 0;
  uint64_t num_experts = 1;  // 1 = dense MLP
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections carry biases (Qwen2)
  bool o_bias = false;    // the output projection carries a bias
  bool mlp_bias = false;  // gate/up/down carry biases
};

// What the model needs to know about an LLM. Whole model, one shard
// (tensor-parallel world size 1).
struct ModelSpec {
  std::string name;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  // Parameters (weights) of the whole model.
  uint64_t param_count = 0;
  // Bytes one weight occupies in memory: 2 for bfloat16/float16, 4 for float32.
  double weight_bytes_per_param = 2.0;
  // The HF torch_dtype the weights come in ("bfloat16", "float16", "float32").
  std::string weight_dtype = "bfloat16";
  // The engine's 16-bit KV dtype: the native sections of a codec. FP16 when
  // the weights are float16, BF16 otherwise (the codec has no 32-bit format).
  codec::DType kv_dtype = codec::DType::kBF16;
  Architecture arch;
};

// How KV is chunked when it is stored; bytes per token include each chunk's
// scales and 16-byte padding, so they depend (slightly) on these.
struct ChunkingOptions {
  // Tokens per kvtier chunk (DESIGN.md "Keys"). Default: 256.
  uint32_t chunk_tokens = 256;
  // The engine's paged-cache block size, in tokens: the group of a
  // per-(block, head) scale. Default: 16.
  uint32_t block_size = 16;
};

// InvalidArgument (naming the field) unless layers, kv heads, head dim and
// the parameter count are positive, within codec/format.h's limits, and the
// weight bytes per parameter are positive.
absl::Status ValidateModel(const ModelSpec& model);

// Parameter count of a decoder-only transformer with a gated MLP (the
// Llama/Qwen2/Mistral/Phi-3 family), from model.num_layers, num_kv_heads,
// head_dim and model.arch (H = hidden, A = attention heads, K = kv heads,
// D = head_dim, I = intermediate, E = experts, V = vocab):
//   embeddings   V*H
//   per layer    q A*D*H, k and v K*D*H each, o A*D*H   (+ A*D, 2*K*D if qkv_bias, + H if o_bias)
//                MLP E*3*H*I (gate, up, down)           (+ E*(2*I + H) if mlp_bias)
//                router H*E when E > 1
//                2 RMSNorm weights, 2*H
//   final norm   H
//   lm_head      V*H unless tie_word_embeddings
// Rotary embeddings have no parameters. Exact for the presets (checked in
// the tests against the published counts).
// InvalidArgument naming the first field that is zero.
absl::StatusOr<uint64_t> EstimateParamCount(const ModelSpec& model);

// KV bytes per token of `model` under `codec`:
//   bytes_per_token = (K section + V section of one chunk) / chunk_tokens
// where each section is layers x align16(tokens x kv_heads x head_dim x bits/8)
// plus, for quantized sections, align16(4 x scales per layer) per layer
// (codec/FORMAT.md "Sections"; computed by codec::BytesPerToken).
// For k16v16: 2 x layers x kv_heads x head_dim x 2 exactly.
// InvalidArgument if the model or chunking is outside the format's limits.
absl::StatusOr<double> KvBytesPerToken(const ModelSpec& model, const codec::CodecFormat& codec,
                                       const ChunkingOptions& chunking = {});

// KV bytes one decode step streams at batch `batch`, context `context`
// tokens per sequence: batch x context x bytes_per_token.
double StepKvBytes(double bytes_per_token, uint64_t context, uint64_t batch);

// Weight bytes one decode step streams: param_count x weight_bytes_per_param
// (every weight is read once per step).
double WeightBytes(const ModelSpec& model);

// Bandwidth (bytes/s) that streams `bytes` within `latency_s` seconds:
// bytes / latency_s. REQUIRES: latency_s > 0.
double RequiredBandwidth(double bytes, double latency_s);

// How many times faster a link would have to be: required / link (both B/s).
// <= 1 means the link covers the requirement. REQUIRES: link_bytes_per_s > 0.
double Shortfall(double required_bytes_per_s, double link_bytes_per_s);

// Fraction of a decode step's traffic that is KV: kv / (kv + weights), in
// [0, 1]; 0 when both are 0.
double KvFraction(double kv_bytes, double weight_bytes);

// Upper bound on the decode-step speedup of a codec that keeps fraction `c`
// of the KV bytes, when fraction `f` of the (uncompressed) step traffic is
// KV and the step is bandwidth bound: 1 / (f*c + (1 - f)).
double CodecSpeedupBound(double f, double c);

// The batch-saturation (Hill) curve S(B) = Smax * B^g / (Bh^g + B^g):
// throughput gain of batching B sequences, saturating at Smax; Bh is the
// batch of half saturation. The defaults are a fit over 767 H100 decode
// configurations.
struct HillCurve {
  double s_max = 3.75;
  double b_half = 5.1;
  double g = 1.32;
};

// InvalidArgument unless every parameter is positive and finite.
absl::Status ValidateHill(const HillCurve& hill);

// S(B) for `batch` >= 0.
double HillSaturation(const HillCurve& hill, double batch);

// --- Load or recompute (the placement engine's estimate of a cached prefix).

// Microseconds to read `bytes` from a tier that answers after `latency_us`
// and then streams at `bytes_per_s`. REQUIRES: bytes_per_s > 0.
double LoadMicros(uint64_t bytes, double bytes_per_s, double latency_us);

// What a prefill costs the engine: the recompute side of load or recompute.
// A token at context position c (c tokens before it) costs 2*P FLOPs in the
// weights (P non-embedding parameters) plus 4*L*Hq*D*c in attention (L
// layers, Hq query heads, D head dim: QK^T and the weighted sum of V), so
// its cost grows linearly with c and doubles at c = C2 = P / (2*L*Hq*D).
struct PrefillCost {
  // The engine's prefill throughput, tokens per second: at short context
  // (a few hundred tokens) with attention_doubling_tokens, at the prompts'
  // context without it. 0: not given (the recompute cost is unknown, so
  // nothing is worth loading). Default: 0
  double tokens_per_s = 0;
  // C2: the context length, in tokens, at which one token's prefill costs
  // twice its short-context cost (Llama-3.1-8B about 27K, Qwen2.5-7B about
  // 33K). 0: linear, every token costs 1 / tokens_per_s whatever its
  // position. Default: 0
  double attention_doubling_tokens = 0;
};

// Microseconds a prefill spends recomputing the `tokens` tokens at context
// positions [first_token, first_token + tokens), a = first_token, n = tokens,
// r = prefill.tokens_per_s, C2 = prefill.attention_doubling_tokens:
//   1e6 * n / r * (1 + (a + n/2) / C2)     (C2 > 0)
//   1e6 * n / r                            (C2 == 0: linear)
// i.e. every token costs 1/r plus an attention term linear in its position,
// summed exactly over the range. 0 when r <= 0. It ignores everything that is
// not FLOPs: a prefill that is memory bound at short context, kernels whose
// efficiency changes with length, sliding-window or linear attention (whose
// cost stops growing), and batching with other requests.
// REQUIRES: attention_doubling_tokens >= 0.
double RecomputeMicros(uint64_t first_token, uint64_t tokens, const PrefillCost& prefill);

// RecomputeMicros of each of the first `chunks` chunks of a prefix:
// chunk i covers tokens [i*T, (i+1)*T), T = tokens_per_chunk, so later
// chunks cost more when attention_doubling_tokens > 0.
std::vector<double> ChunkRecomputeMicros(size_t chunks, uint32_t tokens_per_chunk,
                                         const PrefillCost& prefill);

// How many leading chunks of a cached prefix are worth loading instead of
// recomputing: chunk i loads in load_us[i] and recomputes in
// recompute_us[i]. A chunk is usable only after every chunk before it, so
// the choice is a prefix: the n that saves the most time,
// sum_{i<n} (recompute_us[i] - load_us[i]), the shortest on a tie (0 when
// no prefix saves time). Only the first min(load_us.size(),
// recompute_us.size()) chunks are candidates.
struct LoadDecision {
  size_t chunks = 0;       // leading chunks to load
  double load_us = 0;      // their estimated load time
  double recompute_us = 0; // the time recomputing them would take
  double saved_us() const { return recompute_us - load_us; }
};
LoadDecision BestLoadPrefix(std::span<const double> load_us, std::span<const double> recompute_us);

}  // namespace kvtier::bandwidth

#endif  // KVTIER_BANDWIDTH_MODEL_H_

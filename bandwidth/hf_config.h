// Reads a Hugging Face `config.json` into a ModelSpec.
#ifndef KVTIER_BANDWIDTH_HF_CONFIG_H_
#define KVTIER_BANDWIDTH_HF_CONFIG_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "bandwidth/model.h"

namespace kvtier::bandwidth {

// Parses the text of a config.json. `name` becomes ModelSpec::name.
//
// Fields read (from the top level, or from "text_config" when the top level
// has no num_hidden_layers, as in multimodal configs):
//   num_hidden_layers     required
//   num_attention_heads   required
//   num_key_value_heads   defaults to num_attention_heads (HF's rule: no
//                         grouped-query attention)
//   head_dim              when present and not null; else
//                         hidden_size / num_attention_heads (must divide)
//   torch_dtype (or the newer "dtype")  bfloat16 | float16 | float32;
//                         default bfloat16. Sets the weight bytes (2, 2, 4)
//                         and the KV dtype (fp16 for float16, else bf16)
//   hidden_size, intermediate_size, vocab_size, tie_word_embeddings (default
//   false), attention_bias, mlp_bias, num_local_experts / num_experts,
//   model_type ("qwen2*" implies q/k/v biases): for the parameter estimate
// The parameter count is `num_parameters` when the file has it, otherwise
// EstimateParamCount(); a config that allows neither is InvalidArgument
// unless `allow_unknown_params` (the caller supplies the count).
//
// Errors: InvalidArgument, with the field named, for malformed JSON, a
// missing required field, a value of the wrong type, a non-positive number,
// an unknown dtype or a head count that does not divide hidden_size.
absl::StatusOr<ModelSpec> ParseHfConfig(std::string_view json_text, std::string name,
                                        bool allow_unknown_params = false);

// Reads and parses a config.json file; the model is named after the file's
// directory (…/Llama-3.1-8B/config.json -> "Llama-3.1-8B"), or the file
// stem when the directory gives no name. NotFound when the file is missing.
absl::StatusOr<ModelSpec> LoadHfConfig(const std::string& path, bool allow_unknown_params = false);

}  // namespace kvtier::bandwidth

#endif  // KVTIER_BANDWIDTH_HF_CONFIG_H_

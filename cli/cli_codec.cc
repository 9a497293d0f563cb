// `kvtier codec encode|decode`, `kvtier inspect` and `kvtier keys`.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/cli.h"
#include "cli/npy.h"
#include "codec/chunk.h"
#include "codec/codec.h"
#include "codec/prefix_key.h"
#include "common/file.h"
#include "common/status.h"
#include "common/strings.h"

namespace kvtier::cli {
namespace {

using codec::DType;

constexpr uint64_t kMaxInputBytes = uint64_t{16} << 30;

struct EncodeArgs {
  std::string k_path, v_path, out_path;
  std::string dtype = "fp16";
  std::string format = "k16v8";
  uint32_t block_size = 16;
  std::string model_id = "anonymous";
  std::string revision;
  std::string kv_layout = "nhd";
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
};

// Reads an input file. A missing input is a usage error (exit 2), not a
// cache miss (exit 1), so NotFound becomes InvalidArgument here.
absl::StatusOr<std::vector<uint8_t>> ReadInput(const std::string& path, uint64_t max_bytes) {
  auto bytes = ReadFileBytes(path, max_bytes);
  if (bytes.status().code() == absl::StatusCode::kNotFound) {
    return absl::InvalidArgumentError(bytes.status().message());
  }
  return bytes;
}

absl::StatusOr<npy::Array16> LoadNpy(const std::string& path, const char* what) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadInput(path, kMaxInputBytes));
  auto arr = npy::Parse(bytes);
  if (!arr.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (", path, "): ", arr.status().message()));
  }
  return arr;
}

absl::Status RunEncode(const EncodeArgs& a) {
  KVTIER_ASSIGN_OR_RETURN(DType dtype, codec::ParseDType(a.dtype));
  if (dtype != DType::kFP16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError("--dtype must be fp16 or bf16");
  }
  KVTIER_ASSIGN_OR_RETURN(codec::CodecFormat fmt, codec::ParseCodec(a.format, dtype));
  KVTIER_ASSIGN_OR_RETURN(npy::Array16 k, LoadNpy(a.k_path, "--k"));
  KVTIER_ASSIGN_OR_RETURN(npy::Array16 v, LoadNpy(a.v_path, "--v"));
  const char* want_descr = dtype == DType::kFP16 ? "<f2" : "<u2";
  for (const auto* arr : {&k, &v}) {
    if (arr->descr != want_descr) {
      return absl::InvalidArgumentError(absl::StrCat(
          arr == &k ? "--k" : "--v", " has dtype ", arr->descr, "; --dtype ", a.dtype, " needs ",
          want_descr, dtype == DType::kBF16 ? " (uint16 holding bf16 bits)" : " (float16)"));
    }
    if (arr->shape.size() != 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          arr == &k ? "--k" : "--v", " has ", arr->shape.size(),
          " dimensions; want [layers, tokens, kv_heads, head_dim]"));
    }
  }
  if (k.shape != v.shape) return absl::InvalidArgumentError("--k and --v have different shapes");
  for (uint64_t d : k.shape) {
    if (d == 0 || d > UINT32_MAX) return absl::InvalidArgumentError("a dimension is 0 or too large");
  }
  codec::ModelIdentity id{a.model_id, a.revision, a.dtype, a.kv_layout,
                          codec::CodecName(fmt), a.tp_size, a.tp_rank};
  KVTIER_ASSIGN_OR_RETURN(Hash128 fp, codec::ModelFingerprint(id));
  codec::ChunkSpec spec;
  spec.fingerprint = fp;
  spec.geometry = {static_cast<uint32_t>(k.shape[0]), static_cast<uint32_t>(k.shape[2]),
                   static_cast<uint32_t>(k.shape[3]), static_cast<uint32_t>(k.shape[1]),
                   a.block_size};
  spec.dtype = dtype;
  spec.k = fmt.k;
  spec.v = fmt.v;
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> chunk, codec::EncodeChunk(spec, {k.data, v.data}));
  KVTIER_RETURN_IF_ERROR(WriteFileAtomic(a.out_path, chunk));
  std::printf("wrote %s: %zu bytes (%s, %.3fx of 16-bit)\n", a.out_path.c_str(), chunk.size(),
              codec::CodecName(fmt).c_str(),
              static_cast<double>(chunk.size()) / (4.0 * k.data.size()));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> LoadChunk(const std::string& path) {
  return ReadInput(path, codec::kMaxChunkBytes);
}

absl::Status RunDecode(const std::string& path, const std::string& k_out,
                       const std::string& v_out) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, LoadChunk(path));
  KVTIER_ASSIGN_OR_RETURN(codec::DecodedChunk chunk, codec::DecodeChunk(bytes));
  const codec::Geometry& g = chunk.header.spec.geometry;
  std::string descr = chunk.header.spec.dtype == DType::kFP16 ? "<f2" : "<u2";
  std::vector<uint64_t> shape = {g.num_layers, g.num_tokens, g.num_kv_heads, g.head_dim};
  KVTIER_RETURN_IF_ERROR(WriteFileAtomic(k_out, npy::Serialize({descr, shape, std::move(chunk.k)})));
  KVTIER_RETURN_IF_ERROR(WriteFileAtomic(v_out, npy::Serialize({descr, shape, std::move(chunk.v)})));
  std::printf("decoded %s -> %s, %s\n", path.c_str(), k_out.c_str(), v_out.c_str());
  return absl::OkStatus();
}

std::string SectionText(const codec::SectionLayout& s) {
  if (!codec::IsQuantized(s.dtype)) return codec::DTypeName(s.dtype);
  return absl::StrCat(codec::DTypeName(s.dtype), "/", codec::GranularityName(s.granularity));
}

absl::Status RunInspect(const std::string& path, bool json) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, LoadChunk(path));
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h, codec::VerifyChunk(bytes));
  const codec::Geometry& g = h.spec.geometry;
  const uint64_t raw16 = 2 * 2 * g.layer_elements() * g.num_layers;
  const double ratio = static_cast<double>(bytes.size()) / static_cast<double>(raw16);
  std::string codec_name = codec::CodecName({h.spec.k, h.spec.v});
  if (json) {
    std::printf(
        "{\"version\":%u,\"fingerprint\":\"%s\",\"num_layers\":%u,\"num_kv_heads\":%u,"
        "\"head_dim\":%u,\"num_tokens\":%u,\"block_size\":%u,\"dtype\":\"%s\",\"codec\":\"%s\","
        "\"k_format\":\"%s\",\"v_format\":\"%s\",\"flags\":%u,\"header_bytes\":%u,"
        "\"k_section_bytes\":%llu,\"v_section_bytes\":%llu,\"total_bytes\":%zu,"
        "\"bytes_16bit\":%llu,\"ratio_vs_16bit\":%.6f,\"k_checksum\":\"%016llx\","
        "\"v_checksum\":\"%016llx\",\"verified\":true}\n",
        codec::kVersion, h.spec.fingerprint.ToHex().c_str(), g.num_layers, g.num_kv_heads,
        g.head_dim, g.num_tokens, g.block_size, codec::DTypeName(h.spec.dtype), codec_name.c_str(),
        SectionText(h.layout.k).c_str(), SectionText(h.layout.v).c_str(), h.spec.flags,
        codec::kHeaderSize, static_cast<unsigned long long>(h.layout.k.bytes),
        static_cast<unsigned long long>(h.layout.v.bytes), bytes.size(),
        static_cast<unsigned long long>(raw16), ratio,
        static_cast<unsigned long long>(h.k_checksum),
        static_cast<unsigned long long>(h.v_checksum));
    return absl::OkStatus();
  }
  std::printf("chunk        %s (verified: header and section checksums match)\n", path.c_str());
  std::printf("version      %u\n", codec::kVersion);
  std::printf("fingerprint  %s\n", h.spec.fingerprint.ToHex().c_str());
  std::printf("geometry     %u layers x %u tokens x %u kv heads x %u head dim, block size %u\n",
              g.num_layers, g.num_tokens, g.num_kv_heads, g.head_dim, g.block_size);
  std::printf("dtype        %s\n", codec::DTypeName(h.spec.dtype));
  std::printf("codec        %s (K %s, V %s)\n", codec_name.c_str(), SectionText(h.layout.k).c_str(),
              SectionText(h.layout.v).c_str());
  std::printf("flags        0x%04x%s\n", h.spec.flags,
              (h.spec.flags & codec::kFlagNonFinite) ? " (input held NaN/inf)" : "");
  std::printf("sizes        header %u + K %llu + V %llu = %zu bytes\n", codec::kHeaderSize,
              static_cast<unsigned long long>(h.layout.k.bytes),
              static_cast<unsigned long long>(h.layout.v.bytes), bytes.size());
  std::printf("vs 16-bit    %llu bytes: ratio %.4f (%.2fx smaller)\n",
              static_cast<unsigned long long>(raw16), ratio, 1.0 / ratio);
  std::printf("checksums    K %016llx  V %016llx\n", static_cast<unsigned long long>(h.k_checksum),
              static_cast<unsigned long long>(h.v_checksum));
  return absl::OkStatus();
}

struct KeysArgs {
  std::string tokens;  // comma-separated or @FILE of whitespace/comma separated ids
  std::string model_id;
  std::string revision;
  std::string dtype = "bf16";
  std::string kv_layout = "nhd";
  std::string codec = "k16v8";
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  uint32_t chunk_tokens = codec::kDefaultChunkTokens;
  bool partial = false;
};

absl::StatusOr<std::vector<uint32_t>> ParseTokens(const std::string& spec) {
  std::string text = spec;
  if (!spec.empty() && spec[0] == '@') {
    KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadInput(spec.substr(1), 1u << 30));
    text.assign(bytes.begin(), bytes.end());
  }
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(text, absl::ByAnyChar(", \n\t\r"), absl::SkipEmpty())) {
    uint64_t v = 0;
    if (part.size() > 10) return absl::InvalidArgumentError("token id too large");
    for (char c : part) {
      if (c < '0' || c > '9') {
        return absl::InvalidArgumentError(absl::StrCat("token id '", part, "' is not a non-negative integer"));
      }
      v = v * 10 + static_cast<uint64_t>(c - '0');
    }
    if (v > UINT32_MAX) return absl::InvalidArgumentError("token id does not fit in 32 bits");
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

absl::Status RunKeys(const KeysArgs& a) {
  codec::ModelIdentity id{a.model_id, a.revision, a.dtype, a.kv_layout, a.codec, a.tp_size, a.tp_rank};
  KVTIER_ASSIGN_OR_RETURN(Hash128 fp, codec::ModelFingerprint(id));
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens, ParseTokens(a.tokens));
  KVTIER_ASSIGN_OR_RETURN(std::vector<Hash128> keys,
                          codec::ChunkKeys(fp, tokens, a.chunk_tokens, a.partial));
  std::printf("fingerprint %s\n", fp.ToHex().c_str());
  for (size_t i = 0; i < keys.size(); ++i) std::printf("chunk %zu %s\n", i, keys[i].ToHex().c_str());
  return absl::OkStatus();
}

}  // namespace

void RegisterCodecCommands(CLI::App& app, CommandResult& result) {
  auto* codec_cmd = app.add_subcommand("codec", "Encode and decode chunk files (codec/FORMAT.md)");
  codec_cmd->require_subcommand(1);

  static EncodeArgs enc;
  auto* e = codec_cmd->add_subcommand(
      "encode", "Encode K and V arrays [layers, tokens, kv_heads, head_dim] into a chunk file");
  e->add_option("--k", enc.k_path, "K array (.npy, float16, or uint16 holding bf16 bits)")->required();
  e->add_option("--v", enc.v_path, "V array (.npy), same shape and dtype as K")->required();
  e->add_option("--dtype", enc.dtype, "element dtype of the arrays: fp16 or bf16")->capture_default_str();
  e->add_option("--format", enc.format,
                "codec: k16v16, k16v8, k8v8, k16v4, k8v4, k16vi8, ki8vi8 or k=FMT[/GRAN],v=FMT[/GRAN]")
      ->capture_default_str();
  e->add_option("--block-size", enc.block_size, "engine block size in tokens (scale groups)")
      ->capture_default_str();
  e->add_option("--model-id", enc.model_id, "model id for the fingerprint")->capture_default_str();
  e->add_option("--revision", enc.revision, "model revision for the fingerprint");
  e->add_option("--kv-layout", enc.kv_layout, "engine KV layout name for the fingerprint")
      ->capture_default_str();
  e->add_option("--tp-size", enc.tp_size, "tensor-parallel world size")->capture_default_str();
  e->add_option("--tp-rank", enc.tp_rank, "tensor-parallel rank")->capture_default_str();
  e->add_option("-o,--output", enc.out_path, "chunk file to write")->required();
  e->callback(Action(result, [] { return RunEncode(enc); }));

  static std::string dec_in, dec_k, dec_v;
  auto* d = codec_cmd->add_subcommand("decode", "Decode a chunk file into K and V .npy arrays");
  d->add_option("chunk", dec_in, "chunk file")->required();
  d->add_option("--k-out", dec_k, "K output (.npy)")->required();
  d->add_option("--v-out", dec_v, "V output (.npy); values dequantized to the chunk dtype")->required();
  d->callback(Action(result, [] { return RunDecode(dec_in, dec_k, dec_v); }));

  static std::string insp_in;
  static bool insp_json = false;
  auto* i = app.add_subcommand("inspect", "Verify a chunk file and print its header and sizes");
  i->add_option("chunk", insp_in, "chunk file")->required();
  i->add_flag("--json", insp_json, "machine-readable output");
  i->callback(Action(result, [] { return RunInspect(insp_in, insp_json); }));

  static KeysArgs keys;
  auto* k = app.add_subcommand("keys", "Compute the chunk keys (prefix hashes) of a token sequence");
  k->add_option("--tokens", keys.tokens, "token ids: 1,2,3 or @FILE")->required();
  k->add_option("--model-id", keys.model_id, "model id")->required();
  k->add_option("--revision", keys.revision, "model revision");
  k->add_option("--dtype", keys.dtype, "engine dtype")->capture_default_str();
  k->add_option("--kv-layout", keys.kv_layout, "engine KV layout")->capture_default_str();
  k->add_option("--codec", keys.codec, "codec name")->capture_default_str();
  k->add_option("--tp-size", keys.tp_size, "tensor-parallel world size")->capture_default_str();
  k->add_option("--tp-rank", keys.tp_rank, "tensor-parallel rank")->capture_default_str();
  k->add_option("--chunk-tokens", keys.chunk_tokens, "tokens per chunk")->capture_default_str();
  k->add_flag("--partial", keys.partial, "also key the trailing partial chunk");
  k->callback(Action(result, [] { return RunKeys(keys); }));
}

}  // namespace kvtier::cli

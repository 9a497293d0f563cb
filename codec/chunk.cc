#include "codec/chunk.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/coding.h"
#include "common/strings.h"
#include "common/status.h"

namespace kvtier::codec {
namespace {

bool AllZero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<ChunkLayout> ValidateSpec(const ChunkSpec& spec) {
  if (spec.dtype != DType::kFP16 && spec.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("dtype = ", static_cast<int>(spec.dtype),
                                                   " must be 1 (fp16) or 2 (bf16)"));
  }
  for (auto [name, f] : {std::pair{"k_format", spec.k}, std::pair{"v_format", spec.v}}) {
    if ((f.dtype == DType::kFP16 || f.dtype == DType::kBF16) && f.dtype != spec.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(name, " ", DTypeName(f.dtype),
                                                     " differs from the chunk dtype ",
                                                     DTypeName(spec.dtype)));
    }
  }
  if ((spec.flags & ~kKnownFlags) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("flags = 0x", absl::Hex(spec.flags),
                                                   " has unknown bits"));
  }
  return ComputeLayout(spec.geometry, spec.k, spec.v);
}

void WriteHeader(const ChunkSpec& spec, const ChunkLayout& layout, uint64_t k_checksum,
                 uint64_t v_checksum, std::span<uint8_t> out) {
  uint8_t* h = out.data();
  std::memset(h, 0, kHeaderSize);
  StoreLE<uint32_t>(h + kOffMagic, kMagic);
  StoreLE<uint16_t>(h + kOffVersion, kVersion);
  StoreLE<uint16_t>(h + kOffHeaderSize, static_cast<uint16_t>(kHeaderSize));
  std::memcpy(h + kOffFingerprint, spec.fingerprint.bytes.data(), Hash128::kSize);
  StoreLE<uint32_t>(h + kOffNumLayers, spec.geometry.num_layers);
  StoreLE<uint32_t>(h + kOffNumKvHeads, spec.geometry.num_kv_heads);
  StoreLE<uint32_t>(h + kOffHeadDim, spec.geometry.head_dim);
  StoreLE<uint32_t>(h + kOffNumTokens, spec.geometry.num_tokens);
  StoreLE<uint32_t>(h + kOffBlockSize, spec.geometry.block_size);
  h[kOffDType] = static_cast<uint8_t>(spec.dtype);
  h[kOffKFormat] = static_cast<uint8_t>(spec.k.dtype);
  h[kOffVFormat] = static_cast<uint8_t>(spec.v.dtype);
  h[kOffKGranularity] = static_cast<uint8_t>(spec.k.granularity);
  h[kOffVGranularity] = static_cast<uint8_t>(spec.v.granularity);
  h[kOffScaleDType] = static_cast<uint8_t>(ScaleDType::kFP32);
  StoreLE<uint16_t>(h + kOffFlags, spec.flags);
  StoreLE<uint64_t>(h + kOffKSectionBytes, layout.k.bytes);
  StoreLE<uint64_t>(h + kOffVSectionBytes, layout.v.bytes);
  StoreLE<uint64_t>(h + kOffKChecksum, k_checksum);
  StoreLE<uint64_t>(h + kOffVChecksum, v_checksum);
  StoreLE<uint64_t>(h + kOffHeaderChecksum, Checksum64({h, kOffHeaderChecksum}));
}

namespace {

// Parses every field; `check_header_checksum` is off only for SealChunk.
absl::StatusOr<ChunkHeader> ParseFields(std::span<const uint8_t> bytes,
                                        bool check_header_checksum) {
  if (bytes.size() < kHeaderSize) {
    return absl::InvalidArgumentError(absl::StrCat("header: need ", kHeaderSize,
                                                   " bytes, got ", bytes.size()));
  }
  const uint8_t* h = bytes.data();
  uint32_t magic = LoadLE<uint32_t>(h + kOffMagic);
  if (magic != kMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("magic: 0x", absl::Hex(magic, absl::kZeroPad8), " is not a kvtier chunk"));
  }
  uint16_t version = LoadLE<uint16_t>(h + kOffVersion);
  if (version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("version: ", version, " is not supported (this reader knows ", kVersion, ")"));
  }
  uint16_t header_size = LoadLE<uint16_t>(h + kOffHeaderSize);
  if (header_size != kHeaderSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("header_size: ", header_size, " (want ", kHeaderSize, ")"));
  }
  if (check_header_checksum) {
    uint64_t want = LoadLE<uint64_t>(h + kOffHeaderChecksum);
    uint64_t got = Checksum64({h, kOffHeaderChecksum});
    if (want != got) {
      return absl::DataLossError(absl::StrCat("header_checksum: stored 0x", absl::Hex(want),
                                              ", computed 0x", absl::Hex(got)));
    }
  }
  ChunkHeader out;
  ChunkSpec& spec = out.spec;
  std::memcpy(spec.fingerprint.bytes.data(), h + kOffFingerprint, Hash128::kSize);
  spec.geometry.num_layers = LoadLE<uint32_t>(h + kOffNumLayers);
  spec.geometry.num_kv_heads = LoadLE<uint32_t>(h + kOffNumKvHeads);
  spec.geometry.head_dim = LoadLE<uint32_t>(h + kOffHeadDim);
  spec.geometry.num_tokens = LoadLE<uint32_t>(h + kOffNumTokens);
  spec.geometry.block_size = LoadLE<uint32_t>(h + kOffBlockSize);
  spec.dtype = static_cast<DType>(h[kOffDType]);
  spec.k = {static_cast<DType>(h[kOffKFormat]), static_cast<ScaleGranularity>(h[kOffKGranularity])};
  spec.v = {static_cast<DType>(h[kOffVFormat]), static_cast<ScaleGranularity>(h[kOffVGranularity])};
  spec.flags = LoadLE<uint16_t>(h + kOffFlags);
  if (h[kOffScaleDType] != static_cast<uint8_t>(ScaleDType::kFP32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale_dtype: ", h[kOffScaleDType], " is unknown (want 1, fp32)"));
  }
  if (!AllZero(h + kOffReserved0, 4) || !AllZero(h + kOffReserved1, 32)) {
    return absl::InvalidArgumentError("reserved: header bytes that must be zero are not");
  }
  auto layout = ValidateSpec(spec);
  if (!layout.ok()) return layout.status();
  out.layout = *layout;
  uint64_t k_bytes = LoadLE<uint64_t>(h + kOffKSectionBytes);
  uint64_t v_bytes = LoadLE<uint64_t>(h + kOffVSectionBytes);
  if (k_bytes != layout->k.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("k_section_bytes: ", k_bytes,
                                                   " does not match the geometry (",
                                                   layout->k.bytes, ")"));
  }
  if (v_bytes != layout->v.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("v_section_bytes: ", v_bytes,
                                                   " does not match the geometry (",
                                                   layout->v.bytes, ")"));
  }
  out.k_checksum = LoadLE<uint64_t>(h + kOffKChecksum);
  out.v_checksum = LoadLE<uint64_t>(h + kOffVChecksum);
  return out;
}

}  // namespace

absl::StatusOr<ChunkHeader> ParseHeader(std::span<const uint8_t> bytes) {
  return ParseFields(bytes, /*check_header_checksum=*/true);
}

absl::Status VerifySection(const ChunkHeader& header, Section which,
                           std::span<const uint8_t> section) {
  bool is_k = which == Section::kK;
  uint64_t want_len = is_k ? header.layout.k.bytes : header.layout.v.bytes;
  const char* name = is_k ? "k" : "v";
  if (section.size() != want_len) {
    return absl::DataLossError(absl::StrCat("length: ", name, " section is ", section.size(),
                                            " bytes, header says ", want_len));
  }
  uint64_t want = is_k ? header.k_checksum : header.v_checksum;
  uint64_t got = Checksum64(section);
  if (want != got) {
    return absl::DataLossError(absl::StrCat(name, "_checksum: stored 0x", absl::Hex(want),
                                            ", computed 0x", absl::Hex(got)));
  }
  return absl::OkStatus();
}

absl::StatusOr<ChunkHeader> VerifyChunk(std::span<const uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(ChunkHeader header, ParseHeader(chunk));
  if (chunk.size() != header.layout.total_bytes) {
    return absl::DataLossError(absl::StrCat("length: chunk is ", chunk.size(),
                                            " bytes, header says ", header.layout.total_bytes));
  }
  KVTIER_RETURN_IF_ERROR(
      VerifySection(header, Section::kK, chunk.subspan(header.layout.k_offset, header.layout.k.bytes)));
  KVTIER_RETURN_IF_ERROR(
      VerifySection(header, Section::kV, chunk.subspan(header.layout.v_offset, header.layout.v.bytes)));
  return header;
}

absl::StatusOr<VerifiedChunk> AcceptChunk(const ChunkHeader& header, std::span<const uint8_t> chunk,
                                          uint64_t k_checksum, uint64_t v_checksum) {
  if (chunk.size() != header.layout.total_bytes) {
    return absl::DataLossError(absl::StrCat("length: chunk is ", chunk.size(),
                                            " bytes, header says ", header.layout.total_bytes));
  }
  if (k_checksum != header.k_checksum) {
    return absl::DataLossError(absl::StrCat("k_checksum: stored 0x", absl::Hex(header.k_checksum),
                                            ", computed 0x", absl::Hex(k_checksum)));
  }
  if (v_checksum != header.v_checksum) {
    return absl::DataLossError(absl::StrCat("v_checksum: stored 0x", absl::Hex(header.v_checksum),
                                            ", computed 0x", absl::Hex(v_checksum)));
  }
  return VerifiedChunk(header, chunk);
}

absl::Status SealChunk(std::span<uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(ChunkHeader header, ParseFields(chunk, /*check_header_checksum=*/false));
  if (chunk.size() != header.layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("length: buffer is ", chunk.size(),
                                                   " bytes, header says ",
                                                   header.layout.total_bytes));
  }
  uint64_t kc = Checksum64(chunk.subspan(header.layout.k_offset, header.layout.k.bytes));
  uint64_t vc = Checksum64(chunk.subspan(header.layout.v_offset, header.layout.v.bytes));
  WriteHeader(header.spec, header.layout, kc, vc, chunk.first(kHeaderSize));
  return absl::OkStatus();
}

}  // namespace kvtier::codec

#include "codec/chunk.h"

#include <cstring>
#include <vector>

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
  return ComputeLayout(spec.geometry, spec.k, spec.v, spec.version);
}

void WriteHeader(const ChunkSpec& spec, const ChunkLayout& layout, uint64_t k_checksum,
                 uint64_t v_checksum, std::span<uint8_t> out) {
  uint8_t* h = out.data();
  std::memset(h, 0, kHeaderSize);
  StoreLE<uint32_t>(h + kOffMagic, kMagic);
  StoreLE<uint16_t>(h + kOffVersion, layout.version);
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
  if (version < kMinVersion || version > kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("version: ", version,
                                                   " is not supported (this reader knows ",
                                                   kMinVersion, " to ", kVersion, ")"));
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
  spec.version = version;
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

absl::StatusOr<ChunkHeader> ParseUnsealedHeader(std::span<const uint8_t> bytes) {
  return ParseFields(bytes, /*check_header_checksum=*/false);
}

uint64_t RecordChecksum(Section which, uint32_t layer, std::span<const uint8_t> record) {
  return Checksum64(record, (uint64_t{static_cast<uint8_t>(which)} << 32) | layer);
}

std::span<const uint8_t> RecordBytes(const SectionLayout& sec, std::span<const uint8_t> section,
                                     uint32_t layer) {
  return section.subspan(sec.data_offset(layer), sec.layer_stride);
}

uint64_t StoredRecordChecksum(const SectionLayout& sec, std::span<const uint8_t> section,
                              uint32_t layer) {
  return LoadLE<uint64_t>(section.data() + sec.table_offset + uint64_t{8} * layer);
}

uint64_t WriteRecordTable(const SectionLayout& sec, std::span<const uint64_t> digests,
                          std::span<uint8_t> table) {
  std::memset(table.data(), 0, table.size());
  for (uint32_t l = 0; l < sec.num_layers; ++l) StoreLE<uint64_t>(table.data() + 8 * l, digests[l]);
  return Checksum64(table);
}

absl::Status CheckRecordTableHeader(Section which, const SectionLayout& sec, uint64_t want,
                                    std::span<const uint8_t> stored_table) {
  const uint64_t got = Checksum64(stored_table);
  if (stored_table.size() == sec.table_bytes && want == got) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(which == Section::kK ? "k" : "v",
                                          "_checksum: stored 0x", absl::Hex(want),
                                          ", computed 0x", absl::Hex(got),
                                          " over the record table"));
}

namespace {

absl::Status RecordMismatch(Section which, uint32_t layer, uint64_t stored, uint64_t computed) {
  return absl::DataLossError(absl::StrCat(which == Section::kK ? "k" : "v", " record ", layer,
                                          ": stored checksum 0x", absl::Hex(stored),
                                          ", computed 0x", absl::Hex(computed)));
}

}  // namespace

absl::Status CheckRecord(Section which, const SectionLayout& sec, std::span<const uint8_t> section,
                         uint32_t layer, uint64_t computed) {
  const uint64_t stored = StoredRecordChecksum(sec, section, layer);
  if (stored == computed) return absl::OkStatus();
  return RecordMismatch(which, layer, stored, computed);
}

absl::Status CheckRecordTable(Section which, const SectionLayout& sec, uint64_t want,
                              std::span<const uint64_t> computed,
                              std::span<const uint8_t> stored_table, uint32_t first_layer) {
  KVTIER_RETURN_IF_ERROR(CheckRecordTableHeader(which, sec, want, stored_table));
  for (uint32_t j = 0; j < computed.size(); ++j) {
    const uint32_t l = first_layer + j;
    const uint64_t stored = LoadLE<uint64_t>(stored_table.data() + uint64_t{8} * l);
    if (stored != computed[j]) return RecordMismatch(which, l, stored, computed[j]);
  }
  return absl::OkStatus();
}

namespace {

// Version 2: the checksum of every layer record of `section`, in layer order.
std::vector<uint64_t> RecordChecksums(Section which, const SectionLayout& sec,
                                      std::span<const uint8_t> section) {
  std::vector<uint64_t> out(sec.num_layers);
  for (uint32_t l = 0; l < sec.num_layers; ++l) {
    out[l] = RecordChecksum(which, l, RecordBytes(sec, section, l));
  }
  return out;
}

}  // namespace

absl::Status VerifySection(const ChunkHeader& header, Section which,
                           std::span<const uint8_t> section) {
  bool is_k = which == Section::kK;
  const SectionLayout& sec = is_k ? header.layout.k : header.layout.v;
  const char* name = is_k ? "k" : "v";
  if (section.size() != sec.bytes) {
    return absl::DataLossError(absl::StrCat("length: ", name, " section is ", section.size(),
                                            " bytes, header says ", sec.bytes));
  }
  if (header.layout.version >= 2) {
    return CheckRecordTable(which, sec, is_k ? header.k_checksum : header.v_checksum,
                            RecordChecksums(which, sec, section),
                            section.subspan(sec.table_offset, sec.table_bytes));
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
                                          const absl::Status& sections) {
  if (chunk.size() != header.layout.total_bytes) {
    return absl::DataLossError(absl::StrCat("length: chunk is ", chunk.size(),
                                            " bytes, header says ", header.layout.total_bytes));
  }
  if (!sections.ok()) return sections;
  return VerifiedChunk(header, chunk);
}

absl::Status SealChunk(std::span<uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(ChunkHeader header, ParseUnsealedHeader(chunk));
  if (chunk.size() != header.layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("length: buffer is ", chunk.size(),
                                                   " bytes, header says ",
                                                   header.layout.total_bytes));
  }
  const ChunkLayout& l = header.layout;
  uint64_t sums[2];
  for (Section which : {Section::kK, Section::kV}) {
    const bool is_k = which == Section::kK;
    const SectionLayout& sec = is_k ? l.k : l.v;
    std::span<uint8_t> bytes = chunk.subspan(is_k ? l.k_offset : l.v_offset, sec.bytes);
    if (l.version < 2) {
      sums[is_k ? 0 : 1] = Checksum64(bytes);
      continue;
    }
    sums[is_k ? 0 : 1] = WriteRecordTable(sec, RecordChecksums(which, sec, bytes),
                                          bytes.subspan(sec.table_offset, sec.table_bytes));
  }
  WriteHeader(header.spec, header.layout, sums[0], sums[1], chunk.first(kHeaderSize));
  return absl::OkStatus();
}

}  // namespace kvtier::codec

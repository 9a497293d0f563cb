#include "codec/format.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/strings.h"
#include "absl/strings/str_split.h"

namespace kvtier::codec {
namespace {

absl::Status CheckRange(const char* field, uint32_t value, uint32_t lo, uint32_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", value, " is outside [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

uint64_t ScalesPerLayer(ScaleGranularity g, const Geometry& geo) {
  switch (g) {
    case ScaleGranularity::kNone:
      return 0;
    case ScaleGranularity::kPerTensor:
      return 1;
    case ScaleGranularity::kPerBlockHead:
      return uint64_t{geo.num_blocks()} * geo.num_kv_heads;
    case ScaleGranularity::kPerTokenHead:
      return uint64_t{geo.num_tokens} * geo.num_kv_heads;
  }
  return 0;
}

absl::StatusOr<SectionLayout> MakeSection(const char* name, const Geometry& geo,
                                          SectionFormat f, uint16_t version) {
  switch (f.dtype) {
    case DType::kFP16:
    case DType::kBF16:
    case DType::kFP8E4M3:
    case DType::kINT8:
    case DType::kINT4:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          name, "_format = ", static_cast<int>(f.dtype), " is not a known element format"));
  }
  switch (f.granularity) {
    case ScaleGranularity::kNone:
    case ScaleGranularity::kPerTensor:
    case ScaleGranularity::kPerBlockHead:
    case ScaleGranularity::kPerTokenHead:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(name, "_granularity = ",
                                                     static_cast<int>(f.granularity),
                                                     " is not a known scale granularity"));
  }
  if (IsQuantized(f.dtype) == (f.granularity == ScaleGranularity::kNone)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, "_granularity ", GranularityName(f.granularity), " is not allowed with ", name,
        "_format ", DTypeName(f.dtype), IsQuantized(f.dtype) ? " (needs scales)" : " (no scales)"));
  }
  if (f.dtype == DType::kINT4 && geo.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim = ", geo.head_dim, " must be even for ", name, "_format int4"));
  }
  SectionLayout s;
  s.dtype = f.dtype;
  s.granularity = f.granularity;
  s.num_kv_heads = geo.num_kv_heads;
  s.head_dim = geo.head_dim;
  s.block_size = geo.block_size;
  // All factors are bounded by the limits, so these products fit in 64 bits.
  uint64_t bits = geo.layer_elements() * BitsPerElement(f.dtype);
  s.data_bytes = AlignUp((bits + 7) / 8, kSectionAlign);
  s.scale_count = ScalesPerLayer(f.granularity, geo);
  s.scale_bytes = AlignUp(s.scale_count * 4, kSectionAlign);
  s.layer_stride = s.data_bytes + s.scale_bytes;
  s.num_layers = geo.num_layers;
  s.table_offset = s.layer_stride * geo.num_layers;
  s.table_bytes = version >= 2 ? AlignUp(uint64_t{8} * geo.num_layers, kSectionAlign) : 0;
  s.bytes = s.table_offset + s.table_bytes;
  return s;
}

}  // namespace

absl::StatusOr<ChunkLayout> ComputeLayout(const Geometry& geo, SectionFormat k, SectionFormat v,
                                          uint16_t version) {
  if (version < kMinVersion || version > kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("version: ", version, " is not supported (",
                                                   kMinVersion, " to ", kVersion, ")"));
  }
  if (auto s = CheckRange("num_layers", geo.num_layers, 1, kMaxLayers); !s.ok()) return s;
  if (auto s = CheckRange("num_kv_heads", geo.num_kv_heads, 1, kMaxKvHeads); !s.ok()) return s;
  if (auto s = CheckRange("head_dim", geo.head_dim, 1, kMaxHeadDim); !s.ok()) return s;
  if (auto s = CheckRange("num_tokens", geo.num_tokens, 1, kMaxTokens); !s.ok()) return s;
  if (auto s = CheckRange("block_size", geo.block_size, 1, kMaxBlockSize); !s.ok()) return s;
  ChunkLayout layout;
  layout.version = version;
  layout.geometry = geo;
  auto ks = MakeSection("k", geo, k, version);
  if (!ks.ok()) return ks.status();
  auto vs = MakeSection("v", geo, v, version);
  if (!vs.ok()) return vs.status();
  layout.k = *ks;
  layout.v = *vs;
  layout.k_offset = kHeaderSize;
  layout.v_offset = kHeaderSize + layout.k.bytes;
  layout.total_bytes = layout.v_offset + layout.v.bytes;
  if (layout.total_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", layout.total_bytes,
                                                   " bytes exceeds the limit of ",
                                                   kMaxChunkBytes, " (geometry too large)"));
  }
  return layout;
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFP16:
      return "fp16";
    case DType::kBF16:
      return "bf16";
    case DType::kFP8E4M3:
      return "fp8e4m3";
    case DType::kINT8:
      return "int8";
    case DType::kINT4:
      return "int4";
  }
  return "unknown";
}

const char* GranularityName(ScaleGranularity g) {
  switch (g) {
    case ScaleGranularity::kNone:
      return "none";
    case ScaleGranularity::kPerTensor:
      return "tensor";
    case ScaleGranularity::kPerBlockHead:
      return "block-head";
    case ScaleGranularity::kPerTokenHead:
      return "token-head";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (DType t : {DType::kFP16, DType::kBF16, DType::kFP8E4M3, DType::kINT8, DType::kINT4}) {
    if (name == DTypeName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", AsAbsl(name), "' (want fp16, bf16, fp8e4m3, int8 or int4)"));
}

absl::StatusOr<ScaleGranularity> ParseGranularity(std::string_view name) {
  for (ScaleGranularity g : {ScaleGranularity::kNone, ScaleGranularity::kPerTensor,
                             ScaleGranularity::kPerBlockHead, ScaleGranularity::kPerTokenHead}) {
    if (name == GranularityName(g)) return g;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown scale granularity '", AsAbsl(name), "' (want tensor, block-head or token-head)"));
}

namespace {

struct Preset {
  std::string_view name;
  DType k;  // kFP16 stands for "native"
  ScaleGranularity kg;
  DType v;
  ScaleGranularity vg;
};

constexpr ScaleGranularity kNo = ScaleGranularity::kNone;
constexpr ScaleGranularity kBH = ScaleGranularity::kPerBlockHead;
constexpr ScaleGranularity kTH = ScaleGranularity::kPerTokenHead;

constexpr Preset kPresets[] = {
    {"k16v16", DType::kFP16, kNo, DType::kFP16, kNo},
    {"k16v8", DType::kFP16, kNo, DType::kFP8E4M3, kBH},
    {"k8v8", DType::kFP8E4M3, kBH, DType::kFP8E4M3, kBH},
    {"k16v4", DType::kFP16, kNo, DType::kINT4, kTH},
    {"k8v4", DType::kFP8E4M3, kBH, DType::kINT4, kTH},
    {"k16vi8", DType::kFP16, kNo, DType::kINT8, kTH},
    {"ki8vi8", DType::kINT8, kTH, DType::kINT8, kTH},
};

SectionFormat Native(DType t, ScaleGranularity g, DType native) {
  if (t == DType::kFP16 || t == DType::kBF16) return {native, ScaleGranularity::kNone};
  return {t, g};
}

absl::StatusOr<SectionFormat> ParseExplicitSection(std::string_view text, DType native) {
  std::vector<std::string_view> parts;
  for (absl::string_view p : absl::StrSplit(AsAbsl(text), '/')) parts.push_back(AsStd(p));
  if (parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("bad section format '", AsAbsl(text), "'"));
  }
  if (parts[0] == "16") {
    if (parts.size() == 2) {
      return absl::InvalidArgumentError("16-bit sections take no scale granularity");
    }
    return SectionFormat{native, ScaleGranularity::kNone};
  }
  auto dt = ParseDType(parts[0]);
  if (!dt.ok()) return dt.status();
  if (!IsQuantized(*dt)) {
    return absl::InvalidArgumentError(
        absl::StrCat("write 16-bit sections as '16' (native), not '", AsAbsl(parts[0]), "'"));
  }
  ScaleGranularity g = ScaleGranularity::kPerBlockHead;
  if (parts.size() == 2) {
    auto pg = ParseGranularity(parts[1]);
    if (!pg.ok()) return pg.status();
    if (*pg == ScaleGranularity::kNone) {
      return absl::InvalidArgumentError("quantized sections need a scale granularity");
    }
    g = *pg;
  }
  return SectionFormat{*dt, g};
}

}  // namespace

absl::StatusOr<CodecFormat> ParseCodec(std::string_view name, DType native) {
  if (native != DType::kFP16 && native != DType::kBF16) {
    return absl::InvalidArgumentError("the native dtype must be fp16 or bf16");
  }
  for (const Preset& p : kPresets) {
    if (name == p.name) return CodecFormat{Native(p.k, p.kg, native), Native(p.v, p.vg, native)};
  }
  std::vector<std::string_view> parts;
  for (absl::string_view p : absl::StrSplit(AsAbsl(name), ',')) parts.push_back(AsStd(p));
  if (parts.size() == 2 && parts[0].starts_with("k=") && parts[1].starts_with("v=")) {
    auto k = ParseExplicitSection(parts[0].substr(2), native);
    if (!k.ok()) return k.status();
    auto v = ParseExplicitSection(parts[1].substr(2), native);
    if (!v.ok()) return v.status();
    return CodecFormat{*k, *v};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown codec '", AsAbsl(name),
      "' (want k16v16, k16v8, k8v8, k16v4, k8v4, k16vi8, ki8vi8 or k=FMT[/GRAN],v=FMT[/GRAN])"));
}

std::string CodecName(const CodecFormat& c) {
  auto same = [](SectionFormat a, DType t, ScaleGranularity g) {
    if (!IsQuantized(a.dtype)) return !IsQuantized(t);
    return a.dtype == t && a.granularity == g;
  };
  for (const Preset& p : kPresets) {
    if (same(c.k, p.k, p.kg) && same(c.v, p.v, p.vg)) return std::string(p.name);
  }
  auto part = [](SectionFormat s) {
    if (!IsQuantized(s.dtype)) return std::string("16");
    return absl::StrCat(DTypeName(s.dtype), "/", GranularityName(s.granularity));
  };
  return absl::StrCat("k=", part(c.k), ",v=", part(c.v));
}

absl::StatusOr<double> BytesPerToken(const Geometry& geometry, SectionFormat k, SectionFormat v) {
  auto layout = ComputeLayout(geometry, k, v);
  if (!layout.ok()) return layout.status();
  // The records only: the record tables, like the header, are per chunk.
  return static_cast<double>(layout->k.table_offset + layout->v.table_offset) /
         geometry.num_tokens;
}

}  // namespace kvtier::codec

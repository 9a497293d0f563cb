#include "bandwidth/sweep.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/strings.h"

namespace kvtier::bandwidth {

absl::StatusOr<std::vector<SweepRow>> RunSweep(std::span<const ModelSpec> models,
                                               const SweepOptions& options) {
  if (models.empty()) return absl::InvalidArgumentError("no model given");
  if (options.contexts.empty()) return absl::InvalidArgumentError("no context given");
  if (options.batches.empty()) return absl::InvalidArgumentError("no batch given");
  if (options.codecs.empty()) return absl::InvalidArgumentError("no codec given");
  if (options.links.empty()) return absl::InvalidArgumentError("no link given");
  for (uint64_t c : options.contexts) {
    if (c == 0) return absl::InvalidArgumentError("context must be positive");
  }
  for (uint64_t b : options.batches) {
    if (b == 0) return absl::InvalidArgumentError("batch must be positive");
  }
  if (!(options.latency_s > 0) || !std::isfinite(options.latency_s)) {
    return absl::InvalidArgumentError(
        absl::StrCat("latency must be positive, got ", options.latency_s * 1e3, " ms"));
  }
  for (const Link& l : options.links) {
    if (!(l.gb_per_s > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("link '", l.name, "' has no bandwidth"));
    }
  }
  KVTIER_RETURN_IF_ERROR(ValidateHill(options.hill));

  std::vector<SweepRow> rows;
  for (const ModelSpec& model : models) {
    KVTIER_RETURN_IF_ERROR(ValidateModel(model));
    KVTIER_ASSIGN_OR_RETURN(codec::CodecFormat native,
                            codec::ParseCodec("k16v16", model.kv_dtype));
    KVTIER_ASSIGN_OR_RETURN(double native_bpt,
                            KvBytesPerToken(model, native, options.chunking));
    std::vector<std::pair<std::string, double>> codecs;  // canonical name, bytes/token
    for (const std::string& name : options.codecs) {
      KVTIER_ASSIGN_OR_RETURN(codec::CodecFormat c, codec::ParseCodec(name, model.kv_dtype));
      KVTIER_ASSIGN_OR_RETURN(double bpt, KvBytesPerToken(model, c, options.chunking));
      codecs.emplace_back(codec::CodecName(c), bpt);
    }
    const double weights = WeightBytes(model);
    for (uint64_t context : options.contexts) {
      for (uint64_t batch : options.batches) {
        const double f = KvFraction(StepKvBytes(native_bpt, context, batch), weights);
        for (const auto& [codec_name, bpt] : codecs) {
          SweepRow r;
          r.model = model.name;
          r.context = context;
          r.batch = batch;
          r.codec = codec_name;
          r.bytes_per_token = bpt;
          r.native_bytes_per_token = native_bpt;
          r.kv_bytes = StepKvBytes(bpt, context, batch);
          r.weight_bytes = weights;
          r.kv_fraction = f;
          r.codec_ratio = bpt / native_bpt;
          r.speedup_bound = CodecSpeedupBound(f, r.codec_ratio);
          r.required_bytes_per_s = RequiredBandwidth(r.kv_bytes, options.latency_s);
          r.hill_saturation = HillSaturation(options.hill, static_cast<double>(batch));
          for (const Link& l : options.links) {
            LinkShortfall s;
            s.link = l.name;
            s.gb_per_s = l.gb_per_s;
            s.factor = Shortfall(r.required_bytes_per_s, l.bytes_per_s());
            s.covered = s.factor <= 1.0;
            r.shortfall.push_back(std::move(s));
          }
          rows.push_back(std::move(r));
        }
      }
    }
  }
  return rows;
}

}  // namespace kvtier::bandwidth

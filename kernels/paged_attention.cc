// The host-only part of kernels/paged_attention.h: the checks that the kernel
// launcher (paged_attention.cu) and the CPU reference (reference.cc) share.
// Built without CUDA, in kvtier_kernels_ref.
#include "kernels/paged_attention.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

bool Is16(DType t) { return t == DType::kBF16 || t == DType::kFP16; }

}  // namespace

absl::Status ValidateDecodeAttention(const PagedKvLayout& cache, const DecodeAttentionParams& p) {
  KVTIER_RETURN_IF_ERROR(ValidatePagedKvLayout(cache));
  if (p.q == nullptr) return absl::InvalidArgumentError("attention: q is null");
  if (p.out == nullptr) return absl::InvalidArgumentError("attention: out is null");
  if (p.block_table == nullptr) return absl::InvalidArgumentError("attention: block_table is null");
  if (p.seq_lens == nullptr) return absl::InvalidArgumentError("attention: seq_lens is null");
  if (!Is16(p.q_dtype)) {
    return absl::InvalidArgumentError("attention: q_dtype must be fp16 or bf16");
  }
  for (DType t : {cache.k_dtype, cache.v_dtype}) {
    if (Is16(t) && t != p.q_dtype) {
      return absl::InvalidArgumentError(absl::StrCat("attention: cache holds ",
                                                     codec::DTypeName(t), " but q is ",
                                                     codec::DTypeName(p.q_dtype)));
    }
  }
  if (p.batch == 0 || p.max_blocks_per_seq == 0) {
    return absl::InvalidArgumentError("attention: batch and max_blocks_per_seq must be > 0");
  }
  if (p.num_q_heads == 0 || p.num_q_heads % cache.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention: num_q_heads = ", p.num_q_heads,
                                                   " is not a multiple of num_kv_heads = ",
                                                   cache.num_kv_heads));
  }
  if (p.layer >= cache.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: layer ", p.layer, " >= num_layers ", cache.num_layers));
  }
  if (!(p.sm_scale > 0.0f) || !std::isfinite(p.sm_scale)) {
    return absl::InvalidArgumentError("attention: sm_scale must be finite and > 0");
  }
  if (p.host_seq_lens != nullptr) {
    const uint64_t cap = uint64_t{p.max_blocks_per_seq} * cache.block_size;
    for (uint32_t b = 0; b < p.batch; ++b) {
      int32_t len = p.host_seq_lens[b];
      if (len <= 0 || static_cast<uint64_t>(len) > cap) {
        return absl::InvalidArgumentError(absl::StrCat("attention: seq_lens[", b, "] = ", len,
                                                       " is outside [1, ", cap, "]"));
      }
      if (p.host_block_table != nullptr) {
        uint32_t used = (static_cast<uint32_t>(len) + cache.block_size - 1) / cache.block_size;
        for (uint32_t i = 0; i < used; ++i) {
          int32_t id = p.host_block_table[uint64_t{b} * p.max_blocks_per_seq + i];
          if (id < 0 || static_cast<uint32_t>(id) >= cache.num_blocks) {
            return absl::InvalidArgumentError(
                absl::StrCat("attention: block_table[", b, "][", i, "] = ", id,
                             " is outside [0, ", cache.num_blocks, ")"));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier::kernels

"""Combines the kernel benchmark JSON files of one GPU run into kernels.json,
with the ratios the issue asks for (all against baselines of the same run).
Usage: python3 kernel_merge_results.py OUT_DIR"""
import json
import os
import sys


def load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main():
    out = sys.argv[1]
    codec = load(os.path.join(out, "codec.json"))
    attn = load(os.path.join(out, "attention.json"))
    sdpa = load(os.path.join(out, "sdpa.json"))
    merged = {"codec": codec, "attention": attn, "sdpa": sdpa, "summary": {}}
    s = merged["summary"]
    if codec:
        for r in codec["codec_kernels"]:
            key = f"{r['model']}/{r['codec']}"
            s[key] = {k: r[k] for k in ("gather_encode_d2d_vs_memcpy",
                                        "decode_scatter_d2d_vs_memcpy",
                                        "gather_encode_pinned_vs_pinned_memcpy",
                                        "decode_scatter_from_pinned_vs_pinned_h2d_memcpy",
                                        "decode_scatter_from_pinned_chained_vs_pinned_h2d_memcpy",
                                        "decode_scatter_zero_copy_chained_vs_pinned_h2d_memcpy",
                                        "fp16_equivalent_offload_gbps", "fp16_equivalent_load_gbps",
                                        "pinned_d2h_memcpy_gbps", "pinned_h2d_memcpy_gbps")
                      if k in r}
            if "layer_overlap" in r:
                s[key]["layer_overlap"] = {k: r["layer_overlap"][k] for k in (
                    "t_load_s", "t_load_unchained_s", "t_compute_s", "t_serialized_s",
                    "t_overlapped_s", "overlapped_vs_serialized") if k in r["layer_overlap"]}
            if "ratio_p10_p90" in r:
                s[key]["ratio_p10_p90"] = r["ratio_p10_p90"]
    if attn:
        def find(fmt, b, ctx):
            for r in attn["attention"]:
                if r["format"] == fmt and r["batch"] == b and r["context"] == ctx:
                    return r
        k16v8, bf16 = find("k16v8", 32, 8192), find("bf16", 32, 8192)
        fp8 = find("fp8", 32, 8192)
        if k16v8 and bf16:
            s["attention_b32_ctx8k_k16v8_vs_bf16_same_kernel"] = bf16["t_s"] / k16v8["t_s"]
        if k16v8 and fp8:
            s["attention_b32_ctx8k_fp8sym_vs_bf16_same_kernel"] = bf16["t_s"] / fp8["t_s"]
        if sdpa and k16v8:
            for r in sdpa["sdpa_bf16"]:
                if r["batch"] == 32 and r["context"] == 8192:
                    s["attention_b32_ctx8k_k16v8_vs_torch_sdpa_bf16"] = r["t_s"] / k16v8["t_s"]
                    s["attention_b32_ctx8k_bf16_vs_torch_sdpa_bf16"] = r["t_s"] / bf16["t_s"]
        for r in attn.get("kernel_sweep", []):
            layout = "hnd" if r["layout"].endswith("hnd") else "nhd"
            s.setdefault(f"attention_b{r['batch']}_ctx{r['context'] // 1024}k_kernel_sweep_hbm_gbps",
                         {})[f"{r['format']}/{layout}/{r['kernel']}"] = r["hbm_gbps"]
        for r in attn.get("partition_sweep", []):
            s.setdefault(f"attention_b{r['batch']}_ctx{r['context'] // 1024}k_partition_sweep_hbm_gbps",
                         {})[f"{r['format']}/part{r['partition_tokens']}"] = r["hbm_gbps"]
        for r in attn.get("small_batch_sweep", []):
            s.setdefault(f"attention_b{r['batch']}_small_batch_sweep_hbm_gbps", {})[
                f"{r['format']}/ctx{r['context'] // 1024}k/{r['kernel']}"] = r["hbm_gbps"]
        for r in attn.get("layout_sweep", []):
            s.setdefault("attention_b32_ctx8k_hnd_layout_hbm_gbps", {})[r["format"]] = r["hbm_gbps"]
        for key, r in (("bf16", bf16), ("k16v8", k16v8), ("fp8", fp8)):
            if r:
                s[f"attention_b32_ctx8k_{key}_hbm_gbps"] = r["hbm_gbps"]
        if sdpa:
            for r in sdpa["sdpa_bf16"]:
                if r["batch"] == 32 and r["context"] == 8192:
                    s["sdpa_b32_ctx8k_hbm_gbps"] = r["hbm_gbps"]
    with open(os.path.join(out, "kernels.json"), "w") as f:
        json.dump(merged, f, indent=1)
    print(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()

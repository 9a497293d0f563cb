"""Baseline for kernel_attention_bench: PyTorch scaled_dot_product_attention
(enable_gqa) on contiguous BF16 KV, one decode step, same shapes, same GPU,
same run. Usage: python3 kernel_sdpa_bench.py OUT.json"""
import json
import sys

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B
BATCHES = [1, 8, 32, 64]
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]


def bench(b, ctx):
    kv_bytes = 2 * b * HKV * ctx * D * 2
    rotate = max(1, min(8, (1 << 30) // kv_bytes))  # keep repeats out of L2
    g = torch.Generator(device="cuda").manual_seed(1)
    qs, ks, vs = [], [], []
    for _ in range(rotate):
        qs.append(torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g))
        ks.append(torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=g))
        vs.append(torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=g))
    fn = lambda i: F.scaled_dot_product_attention(qs[i % rotate], ks[i % rotate], vs[i % rotate],
                                                  enable_gqa=True)
    out = fn(0)
    assert torch.isfinite(out).all()
    for i in range(5):
        fn(i)
    torch.cuda.synchronize()
    times = []
    iters = 20
    for _ in range(7):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(iters):
            fn(i)
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) / 1e3 / iters)
    times.sort()
    t = times[len(times) // 2]
    del qs, ks, vs
    torch.cuda.empty_cache()
    return {"batch": b, "context": ctx, "t_s": t, "tokens_per_s": b / t,
            "kv_bytes": kv_bytes, "hbm_gbps": kv_bytes / t / 1e9}


def main():
    res = []
    for b in BATCHES:
        for ctx in CONTEXTS:
            r = bench(b, ctx)
            print(f"sdpa bf16 batch {b:3d} ctx {ctx:6d}: {r['t_s']*1e6:9.1f} us "
                  f"{r['hbm_gbps']:7.1f} GB/s")
            res.append(r)
    with open(sys.argv[1], "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                   "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "sdpa_bf16": res}, f, indent=1)


if __name__ == "__main__":
    main()

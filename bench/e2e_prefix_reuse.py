"""End-to-end prefix reuse through kvtier.hf on a transformers Llama.

A model built from the Llama-3.1-8B config with random BF16 weights (or a
checkpoint, --model PATH), a kvtierd started here, prompts whose cached
prefix is 4K, 16K and 32K tokens plus 256 new tokens. Measured, for k16v8
and k16v16:
  - TTFT with full recompute, with the prefix loaded from DRAM, and from
    NVMe (after a restart of kvtierd, whose shutdown flush moves the chunks
    to NVMe and leaves DRAM empty); what kvtierd's plan_load chose given the
    measured prefill rate, and whether that was the faster option;
  - fidelity against the split computation without kvtier (prefill the
    prefix, then the suffix with that cache): k16v16 logits must be
    bit-identical; k16v8's relative L2 error of the next-token logits and of
    the last hidden state, beside the BF16 noise floor (full prefill vs split
    prefill), over --fidelity-prompts prompts;
  - decode tokens/s at batch 1, 8, 32 for way (a) (DynamicCache, SDPA) and
    way (b) (paged K16/V8 cache, kvtier's decode attention);
  - GPU store and load throughput of the chunk bytes against a pinned
    cudaMemcpy of the same size in the same run (the physical baseline).
Writes JSON to --out (default $OUT/e2e_prefix_reuse.json).

    python3 bench/e2e_prefix_reuse.py --kvtierd build/server/kvtierd
    python3 bench/e2e_prefix_reuse.py --tiny --device cpu   # a smoke run on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import kvtier  # noqa: E402
import kvtier.torch  # noqa: E402,F401
from kvtier import hf, hf_paged  # noqa: E402

LLAMA_31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
            rope_theta=500000.0)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- model -------------------------------------------------------------------------


def build_model(args, device):
    import transformers
    from transformers.initialization import no_init_weights
    if args.model:
        m = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
        return m.eval(), args.model
    name = "llama-3.1-8b-config-random-bf16" if not args.tiny else "tiny-llama-random-bf16"
    config = transformers.LlamaConfig(**(TINY if args.tiny else LLAMA_31_8B))
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), no_init_weights():
            m = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, config.initializer_range, generator=g)
    m.config._name_or_path = name
    return m.eval(), name


# ---- daemon ------------------------------------------------------------------------


class Daemon:
    """kvtierd on a temporary socket; restart() keeps its data dir."""

    def __init__(self, path, data_dir, dram_gib, nvme_gib):
        self.path, self.data_dir = path, data_dir
        self.dram_gib, self.nvme_gib = dram_gib, nvme_gib
        self.socket = os.path.join(data_dir, "kvtierd.sock")
        self.proc = None

    def start(self):
        ready = os.path.join(self.data_dir, "ready")
        if os.path.exists(ready):
            os.unlink(ready)
        self.proc = subprocess.Popen(
            [self.path, "--data-dir", os.path.join(self.data_dir, "d"), "--socket", self.socket,
             "--dram-gib", str(self.dram_gib), "--nvme-gib", str(self.nvme_gib), "--hbm-gib", "0",
             "--log-level", "warn", "--ready-file", ready])
        t0 = time.monotonic()
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}")
            if time.monotonic() - t0 > 120:
                raise RuntimeError("kvtierd not ready in 120 s")
            time.sleep(0.05)
        return time.monotonic() - t0

    def stop(self):
        if self.proc is None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=300)
        self.proc = None
        return time.monotonic() - t0


# ---- timing ------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def forward(model, ids, cache=None, hidden=False):
    return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                 output_hidden_states=hidden)


def pinned_copy_gbps(device, nbytes):
    """Pinned host <-> device cudaMemcpy GB/s (h2d, d2h) of nbytes, best of 3."""
    if device.type != "cuda":
        return None, None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best_h2d = best_d2h = float("inf")
    for _ in range(3):
        t, _ = timed(device, lambda: dev.copy_(host, non_blocking=True))
        best_h2d = min(best_h2d, t)
        t, _ = timed(device, lambda: host.copy_(dev, non_blocking=True))
        best_d2h = min(best_d2h, t)
    del host, dev
    return nbytes / best_h2d / 1e9, nbytes / best_d2h / 1e9


# ---- the benchmark -----------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory (from_pretrained); default: random")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kvtierd", default=os.environ.get("KVTIERD", "build/server/kvtierd"))
    ap.add_argument("--prefixes", default="4096,16384,32768")
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--codecs", default="k16v8,k16v16")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each DRAM/recompute case")
    ap.add_argument("--fidelity-prompts", type=int, default=8)
    ap.add_argument("--fidelity-prefix", type=int, default=4096)
    ap.add_argument("--decode-batches", default="1,8,32")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--dram-gib", type=float, default=24)
    ap.add_argument("--nvme-gib", type=float, default=20)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--layer-group", type=int, default=4,
                    help="layers per step of the layer-by-layer load (PrefixReuse.layer_group)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "e2e_prefix_reuse.json"))
    args = ap.parse_args()

    device = torch.device(args.device)
    prefixes = [int(x) for x in args.prefixes.split(",") if x]
    codecs = [c for c in args.codecs.split(",") if c]
    S, C = args.suffix, args.chunk_tokens
    t0 = time.perf_counter()
    model, model_name = build_model(args, device)
    vocab = model.config.vocab_size
    log(f"model {model_name} on {device} in {time.perf_counter() - t0:.1f} s")
    res = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": model_name, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "kvtier_gpu_path": bool(kvtier.has_cuda()) and device.type == "cuda",
        "suffix_tokens": S, "chunk_tokens": C, "layer_group": args.layer_group, "cases": [],
    }
    daemon = None
    try:
        data_dir = tempfile.mkdtemp(prefix="kvtier-e2e-")
        daemon = Daemon(args.kvtierd, data_dir, args.dram_gib, args.nvme_gib)
        res["daemon_start_s"] = daemon.start()
        client = kvtier.Client(socket=daemon.socket)
        gen = torch.Generator().manual_seed(1)

        def prompt(n):
            return torch.randint(0, vocab, (1, n), generator=gen)

        def reuse_for(codec, cl, **kw):
            return hf.PrefixReuse(model, cl, codec=codec, chunk_tokens=C,
                                  layer_group=args.layer_group, **kw)

        # Warm-up: kernels, the pool's CUDA registration, allocator.
        warm = prompt(4 * C + 16)
        for codec in codecs:
            r = reuse_for(codec, client)
            r.prefill(warm[:, :4 * C], last_logits_only=True)
            r.prefill(warm, store=False, last_logits_only=True)
        forward(model, warm.to(device))

        prompts, rates, recompute = {}, {}, {}
        chunk_bytes = {}
        store_rates = {}
        for P in prefixes:
            ids = prompt(P + S)
            prompts[P] = ids
            dev_ids = ids.to(device)
            # Full recompute: the whole prompt through the model.
            times = []
            for _ in range(args.reps):
                t, _ = timed(device, lambda: forward(model, dev_ids))
                times.append(t)
            recompute[P] = min(times)
            rates[P] = (P + S) / recompute[P]
            # The split reference: the prefix, then the suffix on its cache (no kvtier).
            _, pre = timed(device, lambda: forward(model, dev_ids[:, :P]))
            _, ref = timed(device, lambda: forward(model, dev_ids[:, P:], pre.past_key_values))
            ref_logits = ref.logits[:, -1].float().cpu()
            # The prefix cache as the split reference holds it, stored through kvtier.
            pre_cache = pre.past_key_values
            for codec in codecs:
                r = reuse_for(codec, client)
                t_store, n = timed(device, lambda: r.store(ids[:, :P], pre_cache))
                cb = client.plan_load(r.keys(ids)[:1]).chunk_bytes[0]
                chunk_bytes[codec] = cb
                store_rates.setdefault(codec, []).append((n * cb, t_store))
            del ref, pre_cache
            pre = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for codec in codecs:
                res["cases"].append(dict(prefix_tokens=P, codec=codec, source="recompute",
                                         ttft_s=recompute[P], ttft_runs_s=times))
                r = reuse_for(codec, client)
                keys = r.keys(ids)[:P // C]
                plan = client.plan_load(keys, rates[P], C)
                runs = []
                for _ in range(args.reps):
                    t, out = timed(device, lambda: r.prefill(ids, store=False, last_logits_only=True))
                    runs.append(t)
                    assert out.loaded_tokens == P, (out.loaded_tokens, P)
                logits = out.logits[:, -1].float().cpu()
                case = dict(prefix_tokens=P, codec=codec, source="dram", ttft_s=min(runs),
                            ttft_runs_s=runs, tiers=sorted(set(out.tiers)),
                            logits_rel_l2_vs_split=rel_l2(logits, ref_logits),
                            logits_bitexact_vs_split=bool(torch.equal(logits, ref_logits)))
                case.update(_plan_fields(plan, keys, min(runs), recompute[P]))
                res["cases"].append(case)
                log(f"P={P} {codec}: recompute {recompute[P] * 1e3:.1f} ms, dram "
                    f"{min(runs) * 1e3:.1f} ms, plan {case['plan_choice']}, "
                    f"rel {case['logits_rel_l2_vs_split']:.2e}")
                del out
            del dev_ids

        # The largest k16v8 prefix from DRAM: the load overlapped layer by layer at several
        # group sizes, and the load finished before the suffix runs (no overlap).
        P = max(prefixes)
        if "k16v8" in codecs and device.type == "cuda":
            guarded(res, "ttft_sweep", lambda: sweep_ttft(args, res, model, client, device,
                                                           prompts[P], P))

        # Store throughput against a pinned device->host copy of the same bytes.
        h2d, d2h = pinned_copy_gbps(device, 1 << 30)
        res["pinned_h2d_gbps"], res["pinned_d2h_gbps"] = h2d, d2h
        store_gbps = {c: sum(b for b, _ in v) / sum(t for _, t in v) / 1e9
                      for c, v in store_rates.items()}
        res["store_gbps"] = store_gbps
        res["store_vs_pinned_memcpy"] = {c: (g / d2h if d2h else None) for c, g in store_gbps.items()}

        # Load throughput: the largest prefix's chunks fetched (no compute), against
        # a pinned host->device copy of the same bytes.
        P = max(prefixes)
        load_gbps = {}
        for codec in codecs:
            r = reuse_for(codec, client)

            def fetch_all():
                f = r.fetch(prompts[P])
                if hasattr(f.cache, "finish"):
                    f.cache.finish()
                return f
            t, f = timed(device, fetch_all)
            load_gbps[codec] = (f.tokens // C) * chunk_bytes[codec] / t / 1e9
            del f
        res["load_gbps"] = load_gbps
        res["load_vs_pinned_memcpy"] = {c: (g / h2d if h2d else None) for c, g in load_gbps.items()}

        # NVMe: the shutdown flush writes DRAM to NVMe; the restarted daemon's DRAM is empty.
        probe = prompt(16 * C + 1)
        reuse_for(codecs[0], client).prefill(probe, last_logits_only=True)
        client.close()
        res["daemon_stop_flush_s"] = daemon.stop()
        res["daemon_restart_s"] = daemon.start()
        client = kvtier.Client(socket=daemon.socket)
        # Reading the probe's chunks lets kvtierd measure its NVMe read bandwidth,
        # which its load plans then use; it also registers the new pool with CUDA.
        reuse_for(codecs[0], client).prefill(probe, store=False, last_logits_only=True)
        for P in prefixes:
            for codec in codecs:
                r = reuse_for(codec, client)
                keys = r.keys(prompts[P])[:P // C]
                before = client.lookup(keys)
                plan = client.plan_load(keys, rates[P], C)
                t, out = timed(device, lambda: r.prefill(prompts[P], store=False,
                                                         last_logits_only=True))
                case = dict(prefix_tokens=P, codec=codec, source="nvme", ttft_s=t,
                            tiers_before=sorted(set(before)), tiers=sorted(set(out.tiers)),
                            loaded_tokens=out.loaded_tokens)
                case.update(_plan_fields(plan, keys, t, recompute[P]))
                res["cases"].append(case)
                log(f"P={P} {codec}: nvme {t * 1e3:.1f} ms (tiers before {case['tiers_before']}), "
                    f"plan {case['plan_choice']}")
                del out
        res["plans_correct"] = all(c.get("plan_correct", True) for c in res["cases"])
        dram32 = [c for c in res["cases"] if c["source"] == "dram" and c["codec"] == "k16v8"
                  and c["prefix_tokens"] == max(prefixes)]
        if dram32:
            res["ttft_speedup_dram_32k_k16v8"] = recompute[max(prefixes)] / dram32[0]["ttft_s"]
            res["ttft_speedup_dram_32k_k16v8_prefix_tokens"] = max(prefixes)

        guarded(res, "fidelity", lambda: res.__setitem__(
            "fidelity", fidelity(args, model, client, device, prompt, codecs, reuse_for)))
        f = res.get("fidelity", {})
        exact = [c["logits_bitexact_vs_split"] for c in res["cases"]
                 if c["codec"] == "k16v16" and c["source"] == "dram"]
        if "k16v16_bitexact_all" in f:
            exact.append(f["k16v16_bitexact_all"])
        res["k16v16_logits_bitexact"] = bool(all(exact)) if exact else None
        res["k16v8_logits_rel_l2"] = f.get("k16v8_logits_rel_l2_mean")
        guarded(res, "decode", lambda: res.__setitem__(
            "decode", decode(args, model, client, device, prompt, reuse_for)))

        client.close()
        daemon.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    except Exception:  # the numbers measured so far are still written
        res["error"] = traceback.format_exc()
        log(res["error"])
        if daemon is not None and daemon.proc is not None:
            daemon.proc.kill()
    res["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    log(json.dumps({k: v for k, v in res.items() if k not in ("cases", "fidelity", "decode")},
                   indent=1))
    log(f"wrote {args.out}")


def guarded(res, name, fn):
    """Runs one optional part of the benchmark; a failure is recorded, not fatal."""
    try:
        fn()
    except Exception:
        res.setdefault("errors", {})[name] = traceback.format_exc()
        log(res["errors"][name])


def sweep_ttft(args, res, model, client, device, ids, P):
    """TTFT of a k16v8 prefix from DRAM with the load overlapped layer by layer
    at several group sizes, and with the load finished before the suffix runs."""
    C = args.chunk_tokens
    sweep = {}
    for lg in (1, 2, 4, 8):
        r = hf.PrefixReuse(model, client, codec="k16v8", chunk_tokens=C, layer_group=lg)
        runs = [timed(device, lambda: r.prefill(ids, store=False, last_logits_only=True))[0]
                for _ in range(args.reps)]
        sweep[str(lg)] = min(runs)
    res["ttft_dram_k16v8_by_layer_group_s"] = sweep
    r = hf.PrefixReuse(model, client, codec="k16v8", chunk_tokens=C,
                       layer_group=args.layer_group)

    def serial():
        f = r.fetch(ids)
        return forward(model, ids[:, f.tokens:].to(device), f.cache)
    runs = [timed(device, serial)[0] for _ in range(args.reps)]
    res["ttft_dram_k16v8_load_then_compute_s"] = min(runs)
    res["ttft_sweep_prefix_tokens"] = P


def _plan_fields(plan, keys, ttft_load, ttft_recompute):
    choice = "load" if plan.load_chunks > 0 else "recompute"
    faster = "load" if ttft_load < ttft_recompute else "recompute"
    return dict(plan_hits=plan.hits, plan_load_chunks=plan.load_chunks,
                plan_load_us=plan.load_chunks_us, plan_saved_us=plan.saved_us,
                plan_tiers=sorted(set(plan.tiers)), plan_choice=choice, faster=faster,
                plan_correct=choice == faster)


def fidelity(args, model, client, device, prompt, codecs, reuse_for):
    """Over N prompts of fidelity_prefix + suffix tokens: kvtier's logits and last
    hidden state against the split reference, and the BF16 noise floor."""
    P, S, C = args.fidelity_prefix, args.suffix, args.chunk_tokens
    rows = []
    for _ in range(args.fidelity_prompts):
        ids = prompt(P + S)
        d = ids.to(device)
        full = forward(model, d, hidden=True)
        pre = forward(model, d[:, :P])
        split = forward(model, d[:, P:], pre.past_key_values, hidden=True)
        ref_l, ref_h = split.logits[:, -1].float(), split.hidden_states[-1][:, -1].float()
        row = dict(floor_logits_rel_l2=rel_l2(full.logits[:, -1], ref_l),
                   floor_hidden_rel_l2=rel_l2(full.hidden_states[-1][:, -1], ref_h),
                   floor_top1_agree=bool(full.logits[:, -1].argmax() == ref_l.argmax()))
        del full
        for codec in codecs:
            r = reuse_for(codec, client)
            r.store(ids[:, :P], pre.past_key_values)
            out = r.prefill(ids, store=False, last_logits_only=True, output_hidden_state=True)
            assert out.loaded_tokens == P
            lg, hd = out.logits[:, -1].float(), out.hidden_states[:, -1].float()
            row[f"{codec}_logits_rel_l2"] = rel_l2(lg, ref_l)
            row[f"{codec}_hidden_rel_l2"] = rel_l2(hd, ref_h)
            row[f"{codec}_bitexact"] = bool(torch.equal(lg, ref_l))
            row[f"{codec}_top1_agree"] = bool(lg.argmax() == ref_l.argmax())
            del out
        rows.append(row)
        del pre, split
    summary = dict(prompts=len(rows), prefix_tokens=P, suffix_tokens=S, rows=rows)
    for key in rows[0]:
        vals = [row[key] for row in rows]
        if isinstance(vals[0], bool):
            summary[key.replace("_bitexact", "_bitexact_all").replace("_agree", "_agree_all")
                    if key.endswith(("_bitexact", "_agree")) else key] = all(vals)
        else:
            summary[key + "_mean"] = sum(vals) / len(vals)
            summary[key + "_max"] = max(vals)
    return summary


def decode(args, model, client, device, prompt, reuse_for):
    """Decode tokens/s at each batch for way (a) (DynamicCache decoded from
    k16v8 chunks, SDPA) and way (b) (paged K16/V8, kvtier's attention), with a
    context of fidelity_prefix + suffix tokens."""
    P, S, C, N = args.fidelity_prefix, args.suffix, args.chunk_tokens, args.decode_steps
    ids = prompt(P + S)
    reuse_for("k16v8", client).prefill(ids[:, :P], last_logits_only=True)
    rows = []
    vocab = model.config.vocab_size
    for batch in [int(b) for b in args.decode_batches.split(",") if b]:
        steps = torch.randint(0, vocab, (N + 2, batch, 1)).to(device)
        for way in ("a", "b"):
            if way == "a":
                model.set_attn_implementation("sdpa")
                got = reuse_for("k16v8", client).prefill(ids, store=False, last_logits_only=True)
                cache = got.past_key_values
                if batch > 1:
                    cache.batch_repeat_interleave(batch)
            else:
                model.set_attn_implementation(hf_paged.ATTENTION)
                r = hf_paged.PagedPrefixReuse(model, client, codec="k16v8", chunk_tokens=C,
                                              batch=batch, max_new_tokens=N + 8)
                got = r.prefill(ids, store=False, last_logits_only=True)
                cache = got.past_key_values
            with torch.no_grad():
                for i in range(2):
                    model(input_ids=steps[i], past_key_values=cache, use_cache=True)

                def run():
                    for i in range(2, N + 2):
                        model(input_ids=steps[i], past_key_values=cache, use_cache=True)
                t, _ = timed(device, run)
            rows.append(dict(way=way, batch=batch, context_tokens=P + S, steps=N,
                             tokens_per_s=batch * N / t, step_ms=t / N * 1e3,
                             kernel=way == "b" and hf_paged.kernel_available()
                             and device.type == "cuda"))
            log(f"decode way {way} batch {batch}: {batch * N / t:.1f} tok/s")
            del cache, got
            if device.type == "cuda":
                torch.cuda.empty_cache()
    model.set_attn_implementation("sdpa")
    out = dict(rows=rows)
    for batch in {r["batch"] for r in rows}:
        a = next(r for r in rows if r["batch"] == batch and r["way"] == "a")
        b = next(r for r in rows if r["batch"] == batch and r["way"] == "b")
        out[f"b_over_a_batch{batch}"] = b["tokens_per_s"] / a["tokens_per_s"]
    return out


if __name__ == "__main__":
    main()

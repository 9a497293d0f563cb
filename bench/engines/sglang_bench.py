#!/usr/bin/env python3
"""SGLang's HiCache with kvtier as its storage backend, beside SGLang's own
file backend, on multi-turn conversations (the traffic of SGLang's
benchmark/hicache/bench_multiturn.py): one `sglang.launch_server` per peer
over a dummy-weight Llama-3.1-8B shape, the same conversations sent to each.

Each of --clients conversations runs --rounds rounds: round r sends the
conversation's whole history (its earlier user turns and a fixed assistant
turn of --answer-tokens after each) plus a new user turn of --turn-tokens, and
asks for --output-tokens greedy tokens, streamed, so each request's time to
first token is measured. As in bench_multiturn.py's FIFO ready queue, at most
--max-parallel requests are in flight and a conversation's next round joins
the back of the queue when its answer is complete, so every other
conversation takes a turn between two rounds of one. The prompts are token
ids made from --seed, the same for every peer; every peer's outputs are
compared with those of `no_hicache` (else the first peer).

Sizing: the conversations' histories, cycled through in that order, outgrow
SGLang's GPU KV pool (--gpu-tokens) after one round and its host pool
(--hicache-ratio times that) after one or two, so an LRU pool holds none of
the history a request comes back for and later rounds are served by the
storage backend or recomputed. The defaults (32 conversations of 4 rounds of
1,024 + 128 tokens, pools of 16,384 and 32,832 tokens) keep about 144K tokens
of Llama-3.1-8B KV in storage: 19 GB in BF16 files, 14 GB in kvtier k16v8.

Peers: `no_hicache` (SGLang's radix cache on the GPU only), `hicache` (host
pool, no storage backend), `hicache_file` (SGLang's file backend in a
temporary folder), `hicache_kvtier_k16v8` and `hicache_kvtier_k16v16`
(kvtier.sglang.KvtierHiCacheStorage over a kvtierd started here). Writes --out
(JSON: device, sglang_version, workload, per peer TTFT p50/p90/p99 overall and
per round, tokens SGLang reused per round, throughput, outputs_match, SGLang's
cache and storage counters, kvtierd's counters) and the TTFT CDF next to it
(ttft_cdf.py). --merge folds in the peers of an earlier call's file, so the
peers can be split over device calls.

On the lent GPU machine (docs/engines.md, "SGLang on the GPU"):
    scripts/sglang-gpu install && scripts/sglang-gpu unbundle
    eval "$(scripts/sglang-gpu env)"
    python3 bench/engines/sglang_bench.py --peers hicache_kvtier_k16v8,hicache_file \\
        --out $OUT/sglang-multiturn.json
    # the next call: --peers no_hicache,hicache_kvtier_k16v16 --merge <that file>
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ttft_cdf
import vllm_bench  # (the model shape, kvtierd, percentiles, process groups)
import vllm_serve_bench  # (the tokenizer, ports, health, metrics)

PEERS = ("no_hicache", "hicache", "hicache_file", "hicache_kvtier_k16v8",
         "hicache_kvtier_k16v16")
BASE_PEER = "no_hicache"  # whose outputs the others' are compared with, when it ran
# SGLang's counters worth keeping (names contain one of these).
COUNTER_PARTS = ("cache_hit", "hicache", "storage", "prefetch", "backup", "cached_tokens",
                 "prompt_tokens", "generation_tokens")


def conversations(args) -> list:
    """[client][round] -> the prompt's token ids; history is the earlier user
    turns, each followed by a fixed assistant turn."""
    rng = random.Random(args.seed)
    vocab = vllm_bench.MODELS[args.model]["vocab_size"]
    out = []
    for _ in range(args.clients):
        history: list = []
        prompts = []
        for _ in range(args.rounds):
            turn = [rng.randrange(1000, vocab - 1000) for _ in range(args.turn_tokens)]
            prompts.append(history + turn)
            history = history + turn + [rng.randrange(1000, vocab - 1000)
                                        for _ in range(args.answer_tokens)]
        out.append(prompts)
    return out


def generate(port: int, ids: list, output_tokens: int, timeout_s: float) -> dict:
    """One streamed /generate request: its TTFT, end-to-end time and output."""
    body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": output_tokens, "ignore_eos": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    start = time.perf_counter()
    ttft = None
    last: dict = {}
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/generate answered {resp.status}: {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            if ttft is None:
                ttft = time.perf_counter() - start
            last = json.loads(data)
    finally:
        conn.close()
    if ttft is None:
        raise RuntimeError("/generate streamed nothing")
    meta = last.get("meta_info", {})
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - start, "text": last.get("text"),
            "output_ids": last.get("output_ids"), "cached_tokens": meta.get("cached_tokens"),
            "cached_tokens_details": meta.get("cached_tokens_details"),
            "completion_tokens": meta.get("completion_tokens")}


def drive(args, port: int, convs: list) -> dict:
    """bench_multiturn.py's FIFO order: --max-parallel workers take the next
    (conversation, round) from one queue; a finished round queues the
    conversation's next one at the back. The first failure stops every worker."""
    results: list = [[None] * args.rounds for _ in convs]
    todo: queue.Queue = queue.Queue()
    for c in range(len(convs)):
        todo.put((c, 0))
    left = [len(convs) * args.rounds]
    failed: list = []
    mu = threading.Lock()
    start = time.perf_counter()

    def worker() -> None:
        while (item := todo.get()) is not None:
            c, r = item
            try:
                sent = time.perf_counter() - start
                res = generate(port, convs[c][r], args.output_tokens, args.request_timeout_s)
                res["sent_s"] = sent
                results[c][r] = res
            except Exception as e:  # noqa: BLE001 - reported after the workers stop
                failed.append(e)
            with mu:
                left[0] -= 1
                stop = bool(failed) or left[0] == 0
            if stop:
                for _ in range(args.max_parallel):
                    todo.put(None)
            elif r + 1 < args.rounds:
                todo.put((c, r + 1))

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(args.max_parallel)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if failed:
        raise failed[0]
    return {"duration_s": time.perf_counter() - start, "per_client": results}


def server_command(args, peer: str, model_dir: Path, port: int, socket: str | None) -> list:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
           "--tokenizer-path", str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16",
           "--host", "127.0.0.1", "--port", str(port), "--random-seed", "0",
           "--page-size", str(args.page_size), "--max-total-tokens", str(args.gpu_tokens),
           "--mem-fraction-static", str(args.mem_fraction_static),
           "--context-length", str(args.context_length),
           "--attention-backend", args.attention_backend, "--enable-metrics"]
    if peer != "no_hicache":
        cmd += ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio),
                "--hicache-mem-layout", "page_first", "--hicache-write-policy", "write_through",
                "--hicache-storage-prefetch-policy", args.prefetch_policy]
    if not args.cuda_graph:
        cmd.append("--disable-cuda-graph")
    if peer == "hicache_file":
        cmd += ["--hicache-storage-backend", "file"]
    elif peer.startswith("hicache_kvtier_"):
        cmd += ["--hicache-storage-backend", "dynamic",
                "--hicache-storage-backend-extra-config", json.dumps({
                    "backend_name": "kvtier", "module_path": "kvtier.sglang",
                    "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
                    "socket": socket, "codec": peer.rsplit("_", 1)[1],
                    # SGLang asks on its prefetch thread: a slow answer only
                    # delays that request, a timed-out one recomputes it.
                    "lookup_timeout_ms": 2000})]
    return cmd


def counters(port: int) -> dict:
    try:
        values = vllm_serve_bench.read_metrics(port)
    except OSError:
        return {}
    return {k: v for k, v in values.items()
            if any(p in k for p in COUNTER_PARTS) and not k.endswith("_bucket")}


def reused(requests: list) -> dict:
    """Prompt tokens SGLang took from each of its tiers instead of computing
    them (its cached_tokens_details: GPU pool, host pool, storage backend)."""
    out = {"device": 0, "host": 0, "storage": 0}
    for r in requests:
        details = r.get("cached_tokens_details") or {"device": r["cached_tokens"] or 0}
        for tier in out:
            out[tier] += int(details.get(tier) or 0)
    return out


def summarize(run: dict, args) -> dict:
    ttfts = [r["ttft_s"] * 1e3 for c in run["per_client"] for r in c]
    rounds = {}
    for i in range(args.rounds):
        t = [c[i]["ttft_s"] * 1e3 for c in run["per_client"]]
        rounds[str(i + 1)] = {
            "p50_ms": vllm_bench.percentile(t, 0.5), "p90_ms": vllm_bench.percentile(t, 0.9),
            "cached_tokens": sum(c[i]["cached_tokens"] or 0 for c in run["per_client"]),
            "reused_tokens": reused([c[i] for c in run["per_client"]])}
    n = len(ttfts)
    return {"median_ttft_ms": vllm_bench.percentile(ttfts, 0.5),
            "p90_ttft_ms": vllm_bench.percentile(ttfts, 0.9),
            "p99_ttft_ms": vllm_bench.percentile(ttfts, 0.99),
            "mean_ttft_ms": sum(ttfts) / n, "ttft_by_round": rounds,
            "request_throughput": n / run["duration_s"], "duration_s": run["duration_s"],
            "completed": n, "ttfts_ms": ttfts,
            "cached_tokens": sum(r["cached_tokens"] or 0 for c in run["per_client"] for r in c),
            "reused_tokens": reused([r for c in run["per_client"] for r in c])}


def run_peer(args, peer: str, model_dir: Path, tmp: Path, convs: list) -> dict:
    daemon, socket = None, None
    if peer.startswith("hicache_kvtier_"):
        daemon, socket = vllm_bench.start_kvtierd(args, tmp, peer)
    port = vllm_serve_bench.free_port()
    env = dict(os.environ, SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(tmp / f"file-{peer}"))
    # Triton's compiled kernels in /tmp, which the GPU machine keeps between calls.
    env.setdefault("TRITON_CACHE_DIR", "/tmp/sglang-bench-triton")
    log_path = tmp / f"server-{peer}.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server's whole life
    server = subprocess.Popen(server_command(args, peer, model_dir, port, socket), env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.perf_counter()
    try:
        vllm_serve_bench.wait_healthy(port, server, args.start_timeout_s, "sglang.launch_server")
        started = time.perf_counter() - t0
        # Compiles the Triton kernels before the timed traffic (ids no conversation uses).
        generate(port, list(range(10, 10 + 2 * args.page_size)), 4, args.request_timeout_s)
        run = drive(args, port, convs)
        summary = summarize(run, args)
        summary["server_start_s"] = started
        summary["counters"] = counters(port)
        summary["outputs"] = [[r["text"] for r in c] for c in run["per_client"]]
        if daemon is not None:
            summary["kvtierd"] = vllm_bench.kvtierd_stats(socket)
        return summary
    except Exception:
        print(f"== {peer}: failed; the server's log ends:\n{log_path.read_text()[-4000:]}",
              flush=True)
        raise
    finally:
        vllm_bench.stop_group(server)
        log.close()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="no_hicache,hicache_file,hicache_kvtier_k16v8")
    ap.add_argument("--out", default="sglang-multiturn.json")
    ap.add_argument("--merge", default=None,
                    help="an earlier call's --out: its peers are kept (those run now replace them)")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(vllm_bench.MODELS))
    ap.add_argument("--kvtierd", default=os.environ.get("KVTIERD", "kvtierd"))
    ap.add_argument("--dram-gib", type=float, default=32, help="kvtierd's DRAM tier")
    ap.add_argument("--kvtier-dram-gib", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nvme-gib", type=float, default=0)
    ap.add_argument("--kvtier-huge-pages", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--clients", type=int, default=32, help="conversations")
    ap.add_argument("--max-parallel", type=int, default=4, help="requests in flight")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=1024)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--page-size", type=int, default=64, help="SGLang's page: kvtier's chunk")
    ap.add_argument("--gpu-tokens", type=int, default=16384,
                    help="SGLang's GPU KV pool (--max-total-tokens)")
    ap.add_argument("--hicache-ratio", type=float, default=2.0,
                    help="the host pool, as a multiple of the GPU pool")
    ap.add_argument("--prefetch-policy", default="wait_complete",
                    choices=["best_effort", "wait_complete", "timeout"])
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--context-length", type=int, default=None,
                    help="default: the last round's prompt and output, in whole pages")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture CUDA graphs (off: a faster start, slower decode, alike for all)")
    ap.add_argument("--start-timeout-s", type=float, default=300)
    ap.add_argument("--request-timeout-s", type=float, default=300)
    args = ap.parse_args()
    peers = args.peers.split(",")
    for p in peers:
        if p not in PEERS:
            ap.error(f"unknown peer {p!r}; known: {', '.join(PEERS)}")
    if args.context_length is None:
        need = args.rounds * (args.turn_tokens + args.answer_tokens) + args.output_tokens
        args.context_length = -(-need // args.page_size) * args.page_size
    import sglang
    import torch
    convs = conversations(args)
    out = Path(args.out)
    earlier = Path(args.merge) if args.merge else out
    if args.merge and not earlier.is_file():
        ap.error(f"--merge {args.merge}: no such file (nothing would be merged)")
    results = json.loads(earlier.read_text()) if earlier.exists() else {}
    workload = {k: v for k, v in vars(args).items() if k not in ("out", "kvtierd", "merge")}
    if results.get("peers"):
        same = ("peers", "start_timeout_s", "request_timeout_s")
        differ = sorted(k for k, v in results.get("workload", {}).items()
                        if k not in same and workload.get(k) != v)
        if differ:
            sys.exit(f"{earlier} ran another workload ({', '.join(differ)} differ)")
    results.update({
        "device": torch.cuda.get_device_name(0),
        "sglang_version": sglang.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "workload": workload})
    results.setdefault("peers", {})
    with tempfile.TemporaryDirectory(prefix="sglang-bench-") as d:
        tmp = Path(d)
        model_dir = vllm_bench.make_model_dir(tmp, args.model, None)
        config = vllm_bench.MODELS[args.model]
        vllm_serve_bench.write_tokenizer(model_dir, config["vocab_size"],
                                         config["bos_token_id"], config["eos_token_id"])
        for peer in peers:
            print(f"== {peer}", flush=True)
            results["peers"][peer] = run_peer(args, peer, model_dir, tmp, convs)
            name = BASE_PEER if BASE_PEER in results["peers"] else peers[0]
            base = results["peers"][name]["outputs"]
            for r in results["peers"].values():
                same = sum(a == b for ca, cb in zip(base, r["outputs"], strict=True)
                           for a, b in zip(ca, cb, strict=True))
                r["outputs_matching"] = f"{same}/{sum(map(len, base))}"
                r["outputs_match"] = same == sum(map(len, base))
                r["outputs_compared_with"] = name
            keys = ("median_ttft_ms", "p90_ttft_ms", "mean_ttft_ms", "request_throughput",
                    "reused_tokens", "server_start_s", "outputs_matching")
            print(json.dumps({k: results["peers"][peer].get(k) for k in keys}), flush=True)
            out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".svg").write_text(ttft_cdf.render(results))


if __name__ == "__main__":
    main()

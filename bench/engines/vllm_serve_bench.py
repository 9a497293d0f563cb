#!/usr/bin/env python3
"""The peers under vLLM's own serving benchmark: `vllm serve` per peer, then
`vllm bench serve` against it, the harness users already run.

Workloads (--workload):
  prefix_repetition  vLLM's --dataset-name prefix_repetition: --num-prefixes
                     shared prefixes of --prefix-len tokens, each request one of
                     them plus its own suffix, at --request-rate.
  timed_trace        vLLM's --dataset-name timed_trace replaying the Mooncake
                     conversation trace (shared/traces/; 512-token hash blocks,
                     millisecond timestamps scaled by --time-scale), its first
                     --num-prompts requests.

Peers are those of vllm_bench.py, each on a fresh `vllm serve` (same DRAM
bytes for every cache). With --gpus, peers run at once in lanes of --tp GPUs
(CUDA_VISIBLE_DEVICES), round-robin in the peers' order, each lane one peer
at a time with a compile cache of its own; each peer's entry names its GPUs.
The model is vllm_bench.py's config with dummy weights, and a word-level
tokenizer written here (token i is the word "t<i>", so text round-trips to
the same ids), so no download is needed. The GPU prefix cache is sized with
--num-gpu-blocks-override so that the workload overflows it and the caches'
hit rates, not the GPU's, decide TTFT.

Run on the GPU machine after `scripts/vllm-gpu install` (docs/engines.md):
  eval "$(scripts/vllm-gpu env)"
  python3 bench/engines/vllm_serve_bench.py --workload prefix_repetition --out r.json
Writes a JSON with each peer's `vllm bench serve` summary (TTFT p50/p90/p99,
throughput), its connector counters and whether its greedy outputs equal
no_connector's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket as socketlib
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_bench  # noqa: E402  (the peers, kvtierd, the model shape)

ROOT = Path(__file__).resolve().parents[2]
TRACE_NAME = "mooncake_conversation_trace.jsonl"
# The shared trace beside the checkout, or the copy the engine bundle carries to
# the GPU machine (scripts/vllm-gpu bundle).
TRACES = (ROOT.parent / "shared" / "traces" / TRACE_NAME, ROOT / ".gpubundle-engine" / TRACE_NAME)


def prepare_trace(args, tmp: Path) -> Path:
    """The trace's first --num-prompts requests that fit --max-model-len, each
    output cut to --trace-output-cap tokens (a bounded run; the arrival times and
    the shared hash blocks, which make the prefix reuse, are kept)."""
    rows = []
    with open(args.trace) as f:
        for line in f:
            row = json.loads(line)
            out = min(int(row["output_length"]), args.trace_output_cap)
            if int(row["input_length"]) + out > args.max_model_len:
                continue
            row["output_length"] = out
            rows.append(row)
            if len(rows) == args.num_prompts:
                break
    path = tmp / TRACE_NAME
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tokenizer(model_dir: Path, vocab_size: int, bos: int, eos: int) -> None:
    """A word-level tokenizer: id i is the word "t<i>", split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
        "bos_token": f"t{bos}", "eos_token": f"t{eos}", "model_max_length": 1 << 20,
        "add_bos_token": False, "clean_up_tokenization_spaces": False}))


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float,
                 name: str = "vllm serve") -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} was not healthy in {timeout_s} s")


def serve_command(args, peer: str, model_dir: Path, port: int, socket: str | None) -> list:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
           "--dtype", "bfloat16", "--seed", "0", "--enable-prefix-caching",
           "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--num-gpu-blocks-override", str(args.gpu_blocks),
           "--tensor-parallel-size", str(args.tp)]
    if args.eager:
        cmd.append("--enforce-eager")
    else:
        # CUDA graphs for the batch sizes a few requests a second reach; capturing
        # vLLM's default 67 sizes takes longer than a workload runs.
        cmd += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": args.graph_sizes})]
    config = vllm_bench.kv_transfer_config(peer, args, socket)
    if config is not None:
        cmd += ["--kv-transfer-config", json.dumps(config)]
    return cmd


def bench_command(args, model_dir: Path, port: int, result: Path) -> list:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
           "--model", str(model_dir), "--tokenizer", str(model_dir),
           "--seed", str(args.seed), "--temperature", "0", "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(result.parent),
           "--result-filename", result.name]
    if args.workload == "prefix_repetition":
        cmd += ["--dataset-name", "prefix_repetition", "--num-prompts", str(args.num_prompts),
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.output_len),
                "--request-rate", str(args.request_rate)]
    else:
        cmd += ["--dataset-name", "timed_trace", "--dataset-path", str(args.trace_file),
                "--num-prompts", str(args.num_prompts),
                "--timed-trace-chunk-hash-size", "512",
                "--timed-trace-sec-multiplier", str(0.001 * args.time_scale)]
    return cmd


# The servers and daemons of the peers running now, which main's exit stops
# (a SIGTERM ends the main thread only; lanes are daemon threads).
# {process: True if it leads its own session (a server), False (a daemon)}
_live: dict = {}
_live_mu = threading.Lock()


def _track(proc: subprocess.Popen, on: bool, session: bool = True) -> None:
    with _live_mu:
        if on:
            _live[proc] = session
        else:
            _live.pop(proc, None)


def gpu_lanes(gpus: str | None, tp: int) -> list:
    """The GPU index lists that run peers at once (--gpus, --tp GPUs each), or
    [None]: one lane on the GPUs the environment gives."""
    if not gpus:
        return [None]
    ids = [int(g) for g in gpus.split(",") if g.strip()]
    if len(ids) < tp or len(ids) % tp:
        raise SystemExit(f"--gpus {gpus}: not a multiple of --tp {tp} GPUs")
    return [ids[i:i + tp] for i in range(0, len(ids), tp)]


def lane_env(devs: list | None) -> dict:
    """A lane's GPUs, and a vLLM compile cache of its own (two servers that
    compile at once do not share one)."""
    if devs is None:
        return {}
    tag = "-".join(str(d) for d in devs)
    root = os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm"))
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devs),
            "VLLM_CACHE_ROOT": f"{root}-gpu{tag}"}


# vLLM's scheduler gauges, sampled while the benchmark runs: how many requests
# run and wait, and how full the GPU KV cache is (a connector that keeps a
# finished request's blocks until its store is done fills it for longer).
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def read_metrics(port: int) -> dict:
    """The server's Prometheus samples, name -> value summed over label sets."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values: dict = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def sample_gauges(port: int, stop: threading.Event, out: list, every_s: float = 0.5) -> None:
    """Appends [seconds since start, *GAUGES] to `out` every `every_s` until
    `stop` is set (a gauge vLLM does not export reads as None)."""
    t0 = time.monotonic()
    while not stop.wait(every_s):
        try:
            values = read_metrics(port)
        except OSError:
            continue
        out.append([round(time.monotonic() - t0, 2)] + [values.get(g) for g in GAUGES])


def run_peer(args, peer: str, model_dir: Path, tmp: Path, extra_env: dict | None = None) -> dict:
    daemon, socket = None, None
    if peer.startswith("kvtier_"):
        daemon, socket = vllm_bench.start_kvtierd(args, tmp, peer)
        _track(daemon, True, session=False)
    port = free_port()
    log = open(tmp / f"serve-{peer}.log", "w")  # noqa: SIM115 - the server's whole life
    env = dict(os.environ, PYTHONFAULTHANDLER="1", **vllm_bench.peer_env(peer), **(extra_env or {}))
    if peer == "lmcache":
        env.update({"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": str(args.chunk_tokens),
                    "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.dram_gib)})
    server = subprocess.Popen(serve_command(args, peer, model_dir, port, socket), env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _track(server, True)
    result = tmp / f"bench-{peer}.json"
    try:
        wait_healthy(port, server, args.start_timeout_s)
        # timed_trace makes each hash block's tokens from a seed of Python's
        # str hash, randomized per process: a fixed PYTHONHASHSEED sends every
        # peer the same prompts (their outputs are compared).
        gauges: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_gauges, args=(port, stop, gauges), daemon=True)
        sampler.start()
        try:
            subprocess.run(bench_command(args, model_dir, port, result), check=True,
                           timeout=args.bench_timeout_s,
                           env=dict(os.environ, PYTHONHASHSEED="0"))
        finally:
            stop.set()
            sampler.join()
        summary = json.loads(result.read_text())
        summary["gauges"] = {"columns": ["t_s", *GAUGES], "samples": gauges}
        summary["connector_counters"] = {
            name: value for name, value in read_metrics(port).items()
            if name.startswith(("vllm:kvtier_", "vllm:kv_offload", "vllm:prefix_cache",
                                "vllm:external_prefix_cache")) and "_total" in name}
        return summary
    finally:
        vllm_bench.stop_group(server)
        _track(server, False)
        log.close()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=30)
            _track(daemon, False)
        if not result.exists():
            tail = (tmp / f"serve-{peer}.log").read_text()[-3000:]
            print(f"== {peer}: no result; the server's log ends:\n{tail}", flush=True)


def run_peers(args, peers: list, model_dir: Path, tmp: Path) -> dict:
    """Each peer's summary, or {"error": ...}: read from --raw-dir where it
    is there, else run (in lanes with --gpus) and written there."""
    def raw_path(peer: str) -> Path | None:
        return Path(args.raw_dir) / f"{args.workload}-{peer}.json" if args.raw_dir else None

    summaries: dict = {}
    todo = []
    for peer in peers:
        raw = raw_path(peer)
        if raw is not None and raw.exists():
            summaries[peer] = json.loads(raw.read_text())
        else:
            todo.append(peer)
    lanes = gpu_lanes(args.gpus, args.tp)

    def lane(devs, mine: list) -> None:
        for peer in mine:
            print(f"== {peer}" + (f" (GPUs {devs})" if devs is not None else ""), flush=True)
            try:
                summary = run_peer(args, peer, model_dir, tmp, lane_env(devs))
            except (RuntimeError, subprocess.SubprocessError) as e:
                summaries[peer] = {"error": str(e)}
                continue
            summary["gpus"] = devs
            raw = raw_path(peer)
            if raw is not None:
                raw.parent.mkdir(parents=True, exist_ok=True)
                raw.write_text(json.dumps(summary))
            summaries[peer] = summary

    threads = [threading.Thread(target=lane, args=(devs, todo[i::len(lanes)]), daemon=True)
               for i, devs in enumerate(lanes)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        with _live_mu:
            live = list(_live.items())
        for proc, session in live:  # a SIGTERM left these running
            if session:
                vllm_bench.stop_group(proc)
            else:
                proc.kill()
    return summaries


KEYS = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "request_throughput",
        "output_throughput", "completed", "duration")


def main() -> None:
    vllm_bench.exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("prefix_repetition", "timed_trace"),
                    default="prefix_repetition")
    vllm_bench.add_engine_args(ap, "vllm-serve-bench.json")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--num-prefixes", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--trace", default=str(next((t for t in TRACES if t.exists()), TRACES[0])))
    ap.add_argument("--trace-output-cap", type=int, default=128)
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="multiplies the trace's timestamps (0.5: twice the rate)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--gpu-blocks", type=int, default=4096,
                    help="vLLM's GPU KV blocks (--num-gpu-blocks-override): sized so "
                         "the workload's prefixes overflow it")
    ap.add_argument("--graph-sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 4, 8, 16, 32],
                    help="CUDA graph batch sizes (compiled mode), comma-separated")
    ap.add_argument("--start-timeout-s", type=float, default=300)
    ap.add_argument("--bench-timeout-s", type=float, default=600)
    ap.add_argument("--raw-dir", default=None,
                    help="keep each peer's summary here; a peer whose file exists is not "
                         "run again (a run split over several calls: each server takes "
                         "about two minutes to start)")
    ap.add_argument("--gpus", default=None,
                    help="GPU indices (e.g. 0,1): peers run at once, one per lane of --tp "
                         "GPUs (each peer's entry says which)")
    args = ap.parse_args()
    peers = sorted((p for p in args.peers.split(",") if p), key=vllm_bench.PEERS.index)

    import torch
    import vllm
    tmp = Path(tempfile.mkdtemp(prefix="vllm-serve-bench-"))
    model_dir = vllm_bench.make_model_dir(tmp, args.model, args.layers)
    config = json.loads((model_dir / "config.json").read_text())
    write_tokenizer(model_dir, config["vocab_size"], config["bos_token_id"],
                    config["eos_token_id"])
    if args.workload == "timed_trace":
        args.trace_file = prepare_trace(args, tmp)
    results: dict = {"device": torch.cuda.get_device_name(0), "vllm_version": vllm.__version__,
                     "date": time.strftime("%Y-%m-%d"), "workload": {
                         k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                         if k not in ("peers", "kvtierd", "out")}, "peers": {}}
    outputs: dict = {}
    summaries = run_peers(args, peers, model_dir, tmp)
    for peer in peers:
        summary = summaries[peer]
        if "error" in summary:
            results["peers"][peer] = summary
            continue
        outputs[peer] = summary.get("generated_texts", [])
        entry = {k: summary.get(k) for k in KEYS}
        entry["gpus"] = summary.get("gpus")
        entry["compiled"] = not args.eager
        entry["connector_counters"] = summary["connector_counters"]
        entry["ttfts_ms"] = [1e3 * t for t in summary.get("ttfts", [])]
        entry["gauges"] = summary.get("gauges")
        if "no_connector" in outputs:
            same = [a == b for a, b in zip(outputs[peer], outputs["no_connector"], strict=False)]
            entry["outputs_match_no_connector"] = bool(same) and all(same)
            entry["outputs_matching"] = f"{sum(same)}/{len(same)}"
        results["peers"][peer] = entry
        print(json.dumps({k: v for k, v in entry.items() if not isinstance(v, (list, dict))}),
              flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

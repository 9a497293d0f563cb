#!/usr/bin/env python3
"""kvtier's vLLM connector beside its peers, in one real vLLM on one GPU.

The long-document workload of the vLLM-on-GPU issue: N documents of L tokens,
one request at a time. A cold pass sends each document with a new question
(every connector stores); the GPU prefix cache is then reset (the connectors'
caches are kept) and a warm pass sends the same documents with other questions
(every connector loads). A last pass without a reset measures the GPU prefix
cache's own hit, the floor's compute part.

Each peer runs in its own process with a fresh engine, in the order given:
  no_connector    vLLM with prefix caching and no connector (recompute)
  offloading      vLLM's OffloadingConnector, cpu_bytes_to_use = --dram-gib
  lmcache         LMCache's LMCacheConnectorV1, local CPU, --dram-gib
  kvtier_k16v16   kvtier, lossless, kvtierd with a --dram-gib DRAM tier
  kvtier_k16v8    kvtier, V in FP8
  kvtier_k16v8_zerocopy  (only when asked for) kvtier k16v8 with the encode
                  kernels writing kvtierd's pool over PCIe themselves
                  (KVTIER_GPU_STAGE_STORES=0) instead of encoding into device
                  memory and copying with the copy engine
  kvtier_k16v8_seal4  (only when asked for) kvtier k16v8 with kvtierd sealing
                  stored chunks on 4 threads (KVTIER_DATA_PATH_THREADS=4), not
                  one per core: leaves the engine's threads their cores
  kvtier_k16v8_nice10  (only when asked for) kvtier k16v8 with kvtierd's
                  sealing threads at nice 10 (KVTIER_DATA_PATH_NICE=10), below
                  the engine's priority
  kvtier_k16v8_savelate  (only when asked for) kvtier k16v8 with
                  save_while_running off: a request's prompt is stored when
                  it finishes, its blocks held until then (the A/B of that
                  setting in one run)
  kvtier_k16v8_twoengines  (only when asked for; two GPUs) two vLLM engines,
                  one per GPU, on one kvtierd: engine A (GPU 0) runs the cold
                  pass and stays up; engine B (GPU 1), which never saw the
                  documents, runs the warm and gpu_hit passes, so every warm
                  hit is a chunk that A stored

The model is a config.json of --model's shape with dummy weights (vLLM's
load_format="dummy", seeded, so every engine has the same weights) and token-id
prompts (no tokenizer). Greedy outputs are compared with no_connector's.

Hits from NVMe (item 4 of the vLLM-on-GPU issue: no hit slower than
recomputing): `--kvtier-dram-gib 2 --nvme-gib 32 --plan` gives kvtierd a DRAM
tier too small for the documents, so the warm pass loads from NVMe, and lets the
kvtier peers plan load or recompute at the prefill rate of the same run's
no_connector engine; each peer's `warm_over_recompute_max` is its slowest warm
request over no_connector's TTFT of the same request.

Run on the GPU machine after `scripts/vllm-gpu install` (see docs/engines.md):
  eval "$(scripts/vllm-gpu env)"
  python3 bench/engines/vllm_bench.py --kvtierd ./kvtierd --out r.json
Writes the results JSON (schema: docs/engines.md) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEERS = ("no_connector", "offloading", "lmcache", "kvtier_k16v16", "kvtier_k16v8",
         "kvtier_k16v8_zerocopy", "kvtier_k16v8_seal4", "kvtier_k16v8_nice10",
         "kvtier_k16v8_savelate", "kvtier_k16v8_twoengines")
DEFAULT_PEERS = PEERS[:5]


def peer_codec(peer: str) -> str:
    """The codec of a kvtier peer: kvtier_<codec>[_<variant>]."""
    return peer.split("_")[1]


def peer_env(peer: str) -> dict:
    """The environment a peer's engine runs with, beyond the bench's own: the
    GPU path's switches (docs/engines.md) that a variant peer turns."""
    return {"_zerocopy": {"KVTIER_GPU_STAGE_STORES": "0"}}.get(peer[peer.rfind("_"):], {})


def daemon_env(peer: str) -> dict:
    """The environment a kvtier peer's kvtierd runs with, beyond the bench's own."""
    return {"_seal4": {"KVTIER_DATA_PATH_THREADS": "4"},
            "_nice10": {"KVTIER_DATA_PATH_NICE": "10"}}.get(peer[peer.rfind("_"):], {})

# Model shapes (Hugging Face config.json fields); dummy weights.
MODELS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
}


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_model_dir(root: Path, model: str, layers: int | None) -> Path:
    config = dict(MODELS[model])
    if layers:
        config["num_hidden_layers"] = layers
    path = root / model
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def kv_bytes_per_token(config: dict, codec: str) -> float:
    """Bytes of one token's KV over all layers: K at 16 bits, V at 16 or 8."""
    per_layer = config["num_key_value_heads"] * config["head_dim"]
    v_bytes = {"k16v16": 2, "k16v8": 1}[codec]
    return config["num_hidden_layers"] * per_layer * (2 + v_bytes)


def workload(args) -> dict:
    """Token ids of the documents and of each pass's questions (seeded)."""
    import random
    rng = random.Random(args.seed)
    vocab = MODELS[args.model]["vocab_size"]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, vocab - 1000) for _ in range(n)]
    docs = [tokens(args.doc_tokens) for _ in range(args.docs)]
    return {
        "docs": docs,
        "passes": {name: [tokens(args.question_tokens) for _ in docs]
                   for name in ("cold", "warm", "gpu_hit")},
        "warmup": tokens(args.doc_tokens // 2),
    }


# ---- one peer, in its own process ------------------------------------------------------

def kv_transfer_config(peer: str, args, socket: str | None) -> dict | None:
    dram_bytes = int(args.dram_gib * (1 << 30))
    if peer == "no_connector":
        return None
    if peer == "offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": dram_bytes}}
    if peer == "lmcache":
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    codec = peer_codec(peer)
    # docs/engines.md's settings: a cache's failed load is recomputed.
    extra = {"socket": socket, "codec": codec, "chunk_tokens": args.chunk_tokens,
             "measure_prefill_rate": args.measure_prefill}
    if peer.endswith("_savelate"):
        extra["save_while_running"] = False
    if args.plan_rate:
        # The rate at the documents' context, so no attention term on top.
        extra.update(prefill_tokens_per_s=args.plan_rate, attention_doubling_tokens=0)
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def run_requests(llm, prompts: list[list[int]], out_tokens: int, tag: str) -> dict:
    """Sends the prompts one at a time; TTFT is from add_request to the first
    output that carries a token, as the engine's own step loop sees it."""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    engine = llm.llm_engine
    ttft, e2e, outputs, cached, engine_ttft, steps = [], [], [], [], [], []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        first = None
        done = None
        step_s = []  # each engine step's wall time, prefill first
        while done is None:
            s0 = time.perf_counter()
            outs = engine.step()
            step_s.append(time.perf_counter() - s0)
            for out in outs:
                if out.request_id != rid:
                    continue
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    done = out
        t1 = time.perf_counter()
        steps.append(step_s)
        ttft.append((first or t1) - t0)
        e2e.append(t1 - t0)
        outputs.append(list(done.outputs[0].token_ids))
        cached.append(int(getattr(done, "num_cached_tokens", 0) or 0))
        # vLLM's own first-token latency (its frontend's arrival to first token).
        engine_ttft.append(float(getattr(done.metrics, "first_token_latency", 0.0) or 0.0))
    return {"ttft_s": ttft, "e2e_s": e2e, "wall_s": time.perf_counter() - start,
            "outputs": outputs, "cached_tokens": cached, "engine_ttft_s": engine_ttft,
            "step_s": steps}


def reset_gpu_prefix_cache(llm, timeout_s: float) -> float:
    """Resets vLLM's GPU prefix cache once no finished request holds blocks (a
    connector keeps a request's blocks until it stored them); returns the wait."""
    t0 = time.perf_counter()
    while not llm.reset_prefix_cache():
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"the GPU prefix cache did not reset in {timeout_s} s")
        # An idle engine steps only while a connector holds blocks; nudge it.
        llm.llm_engine.step()
        time.sleep(0.01)
    return time.perf_counter() - t0


def connector_counters() -> dict:
    """The connectors' own Prometheus counters in this (the frontend's) process:
    kvtier's vllm:kvtier_* and the OffloadingConnector's vllm:kv_offload_*."""
    from prometheus_client import REGISTRY
    out: dict = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name.startswith(("vllm:kvtier_", "vllm:kv_offload")) and \
                    sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0) + sample.value
    return out


def child(args) -> None:
    import torch
    from vllm import LLM
    peer = args.child
    work = workload(args)
    if peer == "lmcache":
        os.environ.update({"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE":
                           str(args.chunk_tokens),
                           "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.dram_gib)})
    compiled = not args.eager
    kwargs = dict(
        model=args.model_dir, load_format="dummy", skip_tokenizer_init=True,
        dtype="bfloat16", enable_prefix_caching=True, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.doc_tokens + args.question_tokens + args.output_tokens + 64,
        max_num_batched_tokens=max(16384, args.doc_tokens + args.question_tokens),
        max_num_seqs=8, enforce_eager=not compiled, seed=0, disable_log_stats=False,
        tensor_parallel_size=args.tp)
    if compiled:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    config = kv_transfer_config(peer, args, args.socket)
    if config is not None:
        kwargs["kv_transfer_config"] = config
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    run_requests(llm, [work["warmup"]], args.output_tokens, "warmup")
    reset_gpu_prefix_cache(llm, args.drain_timeout_s)
    docs = work["docs"]

    def run_pass(engine, name: str) -> dict:
        prompts = [d + q for d, q in zip(docs, work["passes"][name])]
        return run_requests(engine, prompts, args.output_tokens, name)
    result = {"peer": peer, "compiled": compiled, "startup_s": startup,
              "gpu": torch.cuda.get_device_name(0), "role": args.child_role}
    if args.child_role in ("both", "store"):
        result["cold"] = run_pass(llm, "cold")
        # Every store of the cold pass has committed once its blocks are free.
        result["drain_s"] = reset_gpu_prefix_cache(llm, args.drain_timeout_s)
    if args.child_role in ("both", "load"):
        result["warm"] = run_pass(llm, "warm")
        result["gpu_hit"] = run_pass(llm, "gpu_hit")
    result["connector_counters"] = connector_counters()
    Path(args.child_out).write_text(json.dumps(result))
    if args.child_role == "store":
        # Engine A stays up (its connector too) while engine B loads what it stored.
        done = Path(args.child_out + ".loaded")
        deadline = time.time() + args.peer_timeout_s
        while not done.exists() and time.time() < deadline:
            time.sleep(0.1)
    # Leave through the engine's own shutdown (its workers, the connector).
    del llm


# ---- the driver ------------------------------------------------------------------------

def pinned_h2d_gb_per_s() -> float:
    import torch
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    rate = reps * n / (time.perf_counter() - t0) / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return rate


def reserve_huge_pages(gib: float) -> None:
    """Reserves enough 2 MiB huge pages for a DRAM pool of `gib` (and a few
    more) in the kernel's hugetlb pool; needs root (vm.nr_hugepages)."""
    want = int(gib * 512) + 16
    path = Path("/proc/sys/vm/nr_hugepages")
    if int(path.read_text()) < want:
        path.write_text(str(want))
    free = next(int(line.split()[1]) for line in open("/proc/meminfo")
                if line.startswith("HugePages_Free:"))
    if free < want - 16:
        raise RuntimeError(f"--kvtier-huge-pages: {free} huge pages free, {want - 16} needed")


def start_kvtierd(args, tmp: Path, peer: str) -> tuple[subprocess.Popen, str]:
    d = tmp / f"kvtierd-{peer}"
    d.mkdir()
    socket = str(d / "kvtierd.sock")
    ready = d / "ready"
    dram_gib = args.kvtier_dram_gib or args.dram_gib
    huge = []
    if args.kvtier_huge_pages:
        reserve_huge_pages(dram_gib)
        huge = ["--dram-huge-pages", "true"]
    with open(d / "kvtierd.log", "w") as log:  # the daemon keeps its own descriptor
        proc = subprocess.Popen(
            [args.kvtierd, "--data-dir", str(d), "--socket", socket,
             "--dram-gib", str(dram_gib), "--nvme-gib", str(args.nvme_gib), *huge,
             "--ready-file", str(ready), "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **daemon_env(peer)))
    deadline = time.time() + 60
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"kvtierd did not start: {(d / 'kvtierd.log').read_text()}")
        time.sleep(0.05)
    return proc, socket


def run_peer(cmd: list[str], timeout_s: float, extra_env: dict) -> int:
    """Runs one peer's process in its own session; past the timeout every
    process of it (vLLM's engine core too) dumps its Python threads' stacks
    (faulthandler, on SIGABRT) and is killed, so the GPU is free for the next."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1", **extra_env)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"peer timed out after {timeout_s} s; its stacks follow", flush=True)
        os.killpg(proc.pid, signal.SIGABRT)
        time.sleep(5)
        return -1
    finally:
        stop_group(proc)


def run_two_engines(cmd: list[str], child_out: Path, timeout_s: float) -> int:
    """Engine A on GPU 0 stores (the cold pass) and stays up while engine B on
    GPU 1 loads (the warm passes) from the same kvtierd; writes their passes as
    one peer's raw results."""
    store_out = Path(f"{child_out}.store")
    load_out = Path(f"{child_out}.load")

    def as_role(out: Path, role: str) -> list[str]:
        # argparse keeps the last --child-out.
        return cmd + ["--child-out", str(out), "--child-role", role]
    env = dict(os.environ, PYTHONFAULTHANDLER="1", CUDA_VISIBLE_DEVICES="0")
    a = subprocess.Popen(as_role(store_out, "store"), env=env, start_new_session=True)
    try:
        deadline = time.time() + timeout_s
        while not store_out.exists():
            if a.poll() is not None or time.time() > deadline:
                print(f"engine A stopped before storing (exit {a.poll()})", flush=True)
                return -1
            time.sleep(0.2)
        returncode = run_peer(as_role(load_out, "load"), timeout_s, {"CUDA_VISIBLE_DEVICES": "1"})
        Path(f"{store_out}.loaded").touch()
        try:
            a_code = a.wait(timeout=120)
        except subprocess.TimeoutExpired:
            a_code = -1
        if returncode != 0 or a_code != 0 or not load_out.exists():
            return returncode or a_code or -1
    finally:
        stop_group(a)
    stored, loaded = json.loads(store_out.read_text()), json.loads(load_out.read_text())
    merged = dict(loaded, cold=stored["cold"], drain_s=stored["drain_s"],
                  startup_s=max(stored["startup_s"], loaded["startup_s"]),
                  store_connector_counters=stored["connector_counters"],
                  gpu=f"{stored['gpu']} (A), {loaded['gpu']} (B)")
    child_out.write_text(json.dumps(merged))
    return 0


def stop_group(proc: subprocess.Popen) -> None:
    """Kills a process started in its own session and everything it started
    (vLLM's engine core holds the GPU's memory until it is gone)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kvtierd_stats(socket: str) -> dict:
    import kvtier
    client = kvtier.Client(socket=socket)
    try:
        return client.stats()
    finally:
        client.close()


def summarize(raw: dict, floor_rate: float, config: dict, baseline: dict | None) -> dict:
    cold, warm, gpu_hit = raw["cold"], raw["warm"], raw["gpu_hit"]
    out = {
        "compiled": raw["compiled"],
        "warm_ttft_p50_ms": 1e3 * percentile(warm["ttft_s"], 0.5),
        "warm_ttft_p90_ms": 1e3 * percentile(warm["ttft_s"], 0.9),
        "warm_ttft_p99_ms": 1e3 * percentile(warm["ttft_s"], 0.99),
        "cold_ttft_mean_ms": 1e3 * statistics.fmean(cold["ttft_s"]),
        "cold_ttft_p50_ms": 1e3 * percentile(cold["ttft_s"], 0.5),
        "cold_ttft_max_ms": 1e3 * max(cold["ttft_s"]),
        "cold_wall_s": cold["wall_s"],
        # After the first token: the output's other tokens (decode steps).
        "cold_decode_ms_mean": 1e3 * statistics.fmean(
            e - t for e, t in zip(cold["e2e_s"], cold["ttft_s"])),
        "warm_wall_s": warm["wall_s"],
        "gpu_hit_ttft_p50_ms": 1e3 * percentile(gpu_hit["ttft_s"], 0.5),
        "warm_cached_tokens_mean": statistics.fmean(warm["cached_tokens"]),
        "drain_after_cold_s": raw["drain_s"],
        "startup_s": raw["startup_s"],
        "connector_counters": raw.get("connector_counters", {}),
        "warm_engine_ttft_p50_ms": 1e3 * percentile(warm["engine_ttft_s"], 0.5),
        "cold_engine_ttft_mean_ms": 1e3 * statistics.fmean(cold["engine_ttft_s"]),
        "cold_ttft_ms": [1e3 * t for t in cold["ttft_s"]],
        "cold_e2e_ms": [1e3 * t for t in cold["e2e_s"]],
        "warm_ttft_ms": [1e3 * t for t in warm["ttft_s"]],
    }
    if cold.get("step_s"):
        # Mean wall time of the cold pass's k-th engine step over its requests
        # (after the first request, whose steps run no earlier request's
        # stores): where after the prefill the decode steps lose their time.
        rows = cold["step_s"][1:] or cold["step_s"]
        depth = min(len(r) for r in rows)
        out["cold_step_ms_by_index"] = [
            1e3 * statistics.fmean(r[k] for r in rows) for k in range(depth)]
    if raw["peer"] == "no_connector":
        out["outputs_match_no_connector"] = True
    elif baseline is not None:
        same = [a == b for a, b in zip(warm["outputs"], baseline["warm"]["outputs"])]
        cold_same = [a == b for a, b in zip(cold["outputs"], baseline["cold"]["outputs"])]
        out["outputs_match_no_connector"] = all(same) and all(cold_same)
        out["warm_outputs_matching"] = f"{sum(same)}/{len(same)}"
        # Item 4 of the vLLM-on-GPU issue: no warm request slower than recomputing
        # it (no_connector's TTFT of the same request).
        out["warm_over_recompute_max"] = max(
            a / b for a, b in zip(warm["ttft_s"], baseline["warm"]["ttft_s"]))
        out["cold_outputs_matching"] = f"{sum(cold_same)}/{len(cold_same)}"
        # Which requests differ (their index in the pass), to set beside
        # warm_ttft_ms: a partial load, a recomputed tail, a full load.
        out["warm_outputs_differing"] = [i for i, ok in enumerate(same) if not ok]
        out["cold_outputs_differing"] = [i for i, ok in enumerate(cold_same) if not ok]
    if raw["peer"].startswith("kvtier_"):
        codec = peer_codec(raw["peer"])
        doc_bytes = kv_bytes_per_token(config, codec) * raw["doc_tokens"]
        floor_ms = 1e3 * doc_bytes / (floor_rate * 1e9) + out["gpu_hit_ttft_p50_ms"]
        out["floor_ms"] = floor_ms
        out["warm_ttft_p50_over_floor"] = out["warm_ttft_p50_ms"] / floor_ms
    return out


def driver(args) -> None:
    import torch
    import vllm
    tmp = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    raw_dir = Path(args.raw_dir) if args.raw_dir else tmp
    raw_dir.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(tmp, args.model, args.layers)
    config = json.loads((model_dir / "config.json").read_text())
    rate = pinned_h2d_gb_per_s()
    print(f"pinned host->device: {rate:.1f} GB/s", flush=True)
    raws: dict = {}
    results: dict = {
        "device": torch.cuda.get_device_name(0), "vllm_version": vllm.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "workload": {
            "name": "long-documents", "model": args.model, "layers":
                config["num_hidden_layers"], "weights": "dummy (seeded)",
            "docs": args.docs, "doc_tokens": args.doc_tokens,
            "question_tokens": args.question_tokens, "output_tokens": args.output_tokens,
            "requests_at_a_time": 1, "block_size": args.block_size,
            "chunk_tokens": args.chunk_tokens, "dram_gib": args.dram_gib,
            "kvtier_dram_gib": args.kvtier_dram_gib or args.dram_gib,
            "kvtier_nvme_gib": args.nvme_gib, "kvtier_huge_pages": args.kvtier_huge_pages,
            "tensor_parallel_size": args.tp,
            "plan": args.plan,
            "measure_prefill": args.measure_prefill,
            "passes": "warm-up; cold (stores); GPU prefix cache reset; warm (loads); "
                      "gpu_hit (no reset)"},
        "pinned_h2d_gb_per_s": rate, "peers": {}}
    for peer in args.peers:
        daemon, socket = None, None
        child_out = raw_dir / f"{peer}.json"
        # An earlier call on this machine ran this peer (same flags, same raw dir).
        kept = bool(args.raw_dir) and child_out.exists()
        returncode = 0
        if kept:
            print(f"== {peer}: kept from {child_out}", flush=True)
        elif peer.startswith("kvtier_"):
            daemon, socket = start_kvtierd(args, tmp, peer)
        cmd = [sys.executable, __file__, "--child", peer, "--child-out", str(child_out),
               "--model-dir", str(model_dir)] + args.child_args
        if socket:
            cmd += ["--socket", socket]
        if args.plan and peer.startswith("kvtier_") and "no_connector" in raws:
            base = raws["no_connector"]["cold"]["ttft_s"]
            rate = args.doc_tokens * len(base) / sum(base)
            results["workload"]["plan_prefill_tokens_per_s"] = rate
            cmd += ["--plan-rate", str(rate)]
        if not kept:
            print(f"== {peer}", flush=True)
            t0 = time.perf_counter()
            if peer.endswith("_twoengines"):
                returncode = run_two_engines(cmd, child_out, args.peer_timeout_s)
            else:
                returncode = run_peer(cmd, args.peer_timeout_s, peer_env(peer))
            print(f"== {peer}: exit {returncode} after {time.perf_counter() - t0:.0f} s",
                  flush=True)
        stats = None
        if daemon is not None:
            try:
                stats = kvtierd_stats(socket)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                stats = {"error": str(e)}
            daemon.terminate()
            daemon.wait(timeout=30)
        if returncode != 0 or not child_out.exists():
            results["peers"][peer] = {"error": f"exit {returncode}"}
            if daemon is not None:
                log = (tmp / f"kvtierd-{peer}" / "kvtierd.log").read_text()
                print(f"kvtierd's log:\n{log[-4000:]}", flush=True)
            continue
        raw = json.loads(child_out.read_text())
        raw["doc_tokens"] = args.doc_tokens
        raws[peer] = raw
        summary = summarize(raw, rate, config, raws.get("no_connector"))
        if stats is not None:
            summary["kvtierd_stats"] = stats
            # kvtierd's own counts: the connector's counters in this offline
            # engine's stats undercount (under `vllm serve` they are exact).
            counters = stats.get("counters", {})
            for name in ("puts", "gets", "holds_refused", "hits_dram", "hits_nvme"):
                if name in counters:
                    summary[f"kvtierd_{name}"] = counters[name]
        results["peers"][peer] = summary
        print(json.dumps({k: v for k, v in summary.items()
                          if not isinstance(v, (list, dict))}), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    report(results)
    Path(args.out).write_text(json.dumps(results, indent=1))


def report(results: dict) -> None:
    peers = results["peers"]
    base = peers.get("no_connector", {})
    lm = peers.get("lmcache", {})
    print(f"\n{results['device']}, vLLM {results['vllm_version']}")
    print(f"{'peer':22} {'warm p50':>9} {'/lmcache':>8} {'cold mean':>9} {'/none':>6} "
          f"{'cold wall':>9} {'/none':>6} {'outputs':>8}")
    for name, p in peers.items():
        if "error" in p:
            print(f"{name:22} {p['error']}")
            continue
        def ratio(a, b):
            return f"{a / b:.2f}" if b else "-"
        print(f"{name:22} {p['warm_ttft_p50_ms']:9.1f} "
              f"{ratio(p['warm_ttft_p50_ms'], lm.get('warm_ttft_p50_ms')):>8} "
              f"{p['cold_ttft_mean_ms']:9.1f} "
              f"{ratio(p['cold_ttft_mean_ms'], base.get('cold_ttft_mean_ms')):>6} "
              f"{p['cold_wall_s']:9.2f} {ratio(p['cold_wall_s'], base.get('cold_wall_s')):>6} "
              f"{p.get('outputs_match_no_connector', '-')!s:>8}")


def add_engine_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The flags of the peers, the engine and the model (this and vllm_serve_bench.py)."""
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS))
    ap.add_argument("--kvtierd", default=os.environ.get("KVTIERD", "kvtierd"))
    ap.add_argument("--out", default=out)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--dram-gib", type=float, default=16, help="every cache's DRAM")
    ap.add_argument("--kvtier-dram-gib", type=float, default=None,
                    help="kvtierd's DRAM tier instead of --dram-gib (with --nvme-gib: a "
                         "small one spills the chunks to NVMe)")
    ap.add_argument("--nvme-gib", type=float, default=0, help="kvtierd's NVMe tier")
    ap.add_argument("--kvtier-huge-pages", action="store_true",
                    help="kvtierd's DRAM pool in huge pages (reserves them: needs root)")
    ap.add_argument("--plan", action="store_true",
                    help="kvtier peers plan load or recompute at the prefill rate that the "
                         "same run's no_connector engine reached (its cold TTFT)")
    ap.add_argument("--measure-prefill", action="store_true",
                    help="kvtier peers plan at the prefill rate they measure themselves "
                         "(measure_prefill_rate)")
    ap.add_argument("--plan-rate", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size of every engine (a GPU per rank)")
    ap.add_argument("--seed", type=int, default=7)


def exit_on_sigterm() -> None:
    """A SIGTERM (e.g. an outer `timeout`) exits through the `finally` blocks,
    which stop the engines and servers this process started in their own
    sessions (they would otherwise keep the GPU's memory)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap, "vllm-bench.json")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--doc-tokens", type=int, default=8192)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--raw-dir", help="keep each peer's raw results here; a peer whose "
                    "file exists is not run again (a run split over several calls)")
    ap.add_argument("--drain-timeout-s", type=float, default=120)
    ap.add_argument("--peer-timeout-s", type=float, default=600)
    ap.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--child-role", choices=("both", "store", "load"), default="both",
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    args.peers = [p for p in args.peers.split(",") if p]
    for p in args.peers:
        if p not in PEERS:
            ap.error(f"unknown peer {p!r}; known: {', '.join(PEERS)}")
    # no_connector first: the others' outputs are compared with its.
    args.peers.sort(key=PEERS.index)
    # The workload's flags, passed on to each peer's process.
    args.child_args = sys.argv[1:]
    exit_on_sigterm()
    driver(args)


if __name__ == "__main__":
    main()

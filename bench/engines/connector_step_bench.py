"""The host cost of kvtier's vLLM connector per engine step, on the CPU.

vLLM's own v1 scheduler runs the same requests three times in one process:
once without a connector (the baseline), then with KvtierConnector on both
sides (scheduler and worker) against a real kvtierd, with save_while_running
on (the default) and off, its worker calls made in the
order of vLLM's runner (the harness of python/tests/test_vllm_connector.py,
which plays the model runner over CPU KV tensors that vLLM's allocator made;
no model runs, so the time is the scheduler's and the connector's alone).
Every prompt is new, so nothing is loaded: the connector's cost is its
lookups at admission, the saves it queues (the saver thread encodes them on
the CPU here, where the GPU path only launches copies) and its per-step
calls. Decode steps are the ones with at most one token per request; each round
reports the median decode step and the prefill steps of both, and the
ratio of the medians. Empty steps (the connector's requests waiting for their
saves to finish) are counted, not timed.

Run in the vLLM venv that `make test` builds, from the repository root:
  PYTHONPATH=python KVTIER_LIBRARY=build/client/libkvtier.so \\
  KVTIERD=build/server/kvtierd build/vllm-venv/bin/python \\
  bench/engines/connector_step_bench.py --out step.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "tests"))

import test_vllm_connector as harness
import transformers
import vllm
from conftest import Daemon
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager


def tiny_llama(path: Path) -> str:
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=harness.HEADS * harness.DIM * 2, intermediate_size=64,
        num_hidden_layers=harness.LAYERS, num_attention_heads=harness.HEADS * 2,
        num_key_value_heads=harness.HEADS, head_dim=harness.DIM, max_position_embeddings=4096,
        torch_dtype="bfloat16", eos_token_id=harness.EOS).save_pretrained(path)
    return str(path)


def plain_scheduler(model_dir: str):
    """vLLM's scheduler without a connector and a step that plays the runner."""
    cfg = harness.vllm_config(model_dir, {})
    cfg.kv_transfer_config = None
    kvc, _ = harness.vllm_kv_caches(cfg, "LBNHC")
    cfg.cache_config.num_gpu_blocks = harness.NUM_BLOCKS
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
                      structured_output_manager=StructuredOutputManager(cfg),
                      block_size=harness.BLOCK)

    def step():
        out = sched.schedule()
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=None))
        return out
    return sched, step


def timed_steps(sched, step, args, salt: int) -> list[tuple[float, int]]:
    # Prompts no earlier round stored: every step has nothing to load.
    gen = random.Random(salt)
    for i in range(args.requests):
        prompt = [gen.randrange(250) for _ in range(args.prompt_tokens)]
        sched.add_request(harness.make_request(f"r{salt}-{i}", prompt,
                                               max_tokens=args.output_tokens))
    steps = []
    while sched.requests:
        t0 = time.perf_counter()
        out = step()
        steps.append((time.perf_counter() - t0, out.total_num_scheduled_tokens))
        if out.total_num_scheduled_tokens == 0:
            time.sleep(0.001)  # the saves finish on the connector's thread
        if len(steps) > 100 * (args.output_tokens + args.prompt_tokens):
            raise RuntimeError("the requests did not finish")
    return steps


def summary(steps: list[tuple[float, int]], requests: int) -> dict:
    decode = [s for s, n in steps if 0 < n <= requests]
    prefill = [s for s, n in steps if n > requests]
    return {"decode_steps": len(decode), "decode_step_median_us": statistics.median(decode) * 1e6,
            "prefill_steps_ms": [round(s * 1e3, 3) for s in prefill],
            "empty_steps": sum(1 for _, n in steps if n == 0),
            "total_ms": sum(s for s, _ in steps) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8, help="at a time (the harness's max_num_seqs)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=40)
    ap.add_argument("--out", default="connector-step.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="connector-step-"))
    model_dir = tiny_llama(tmp / "model")
    daemon = Daemon(tmp / "kvtierd").start()
    rounds = []
    try:
        for r in range(args.rounds):
            sched, step = plain_scheduler(model_dir)
            base = summary(timed_steps(sched, step, args, salt=2 * r), args.requests)
            entry = {"no_connector": base}
            # The default, then save_while_running off (every chunk stored at
            # the finish): what following the running requests costs a step.
            for name, ratio_key, extra in (
                    ("kvtier", "decode_step_ratio", {}),
                    ("kvtier_save_late", "decode_step_ratio_save_late",
                     {"save_while_running": False})):
                eng = harness.Engine(model_dir, harness._extra(daemon, **extra))
                try:
                    conn = summary(timed_steps(eng.scheduler, lambda e=eng: e.step(writes=False),
                                               args, salt=2 * r + 1), args.requests)
                finally:
                    eng.shutdown()
                base_us, conn_us = base["decode_step_median_us"], conn["decode_step_median_us"]
                entry[name] = conn
                entry[ratio_key] = conn_us / base_us
                print(f"round {r} {name}: decode step median {base_us:.0f} us without, "
                      f"{conn_us:.0f} us with ({conn_us / base_us:.2f}x, "
                      f"+{conn_us - base_us:.0f} us); prefill steps {base['prefill_steps_ms']} / "
                      f"{conn['prefill_steps_ms']} ms; {conn['empty_steps']} empty", flush=True)
            rounds.append(entry)
    finally:
        daemon.kill()
    result = {"benchmark": "connector-step", "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "vllm_version": vllm.__version__,
              "date": time.strftime("%Y-%m-%d"),
              "workload": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "block_size": harness.BLOCK,
                           "chunk_tokens": harness.CHUNK, "codec": "k16v16",
                           "kv": "CPU tensors of the harness's tiny Llama"},
              "rounds": rounds,
              "decode_step_ratio_median": statistics.median(x["decode_step_ratio"] for x in rounds),
              "decode_step_extra_us_median": statistics.median(
                  x["kvtier"]["decode_step_median_us"] - x["no_connector"]["decode_step_median_us"]
                  for x in rounds),
              "save_late_decode_step_ratio_median": statistics.median(
                  x["decode_step_ratio_save_late"] for x in rounds),
              "save_late_decode_step_extra_us_median": statistics.median(
                  x["kvtier_save_late"]["decode_step_median_us"]
                  - x["no_connector"]["decode_step_median_us"] for x in rounds)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"median over rounds: {result['decode_step_ratio_median']:.2f}x, "
          f"+{result['decode_step_extra_us_median']:.0f} us a decode step of {args.requests} "
          f"requests (save_while_running off: "
          f"{result['save_late_decode_step_ratio_median']:.2f}x, "
          f"+{result['save_late_decode_step_extra_us_median']:.0f} us); wrote {args.out}")


if __name__ == "__main__":
    main()

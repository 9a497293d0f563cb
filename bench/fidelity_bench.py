"""K16/V8 and the other codecs on real trained models, through kvtierd.

For each model (GGUF files from scripts/fetch-models) and each text of
bench/fidelity/: kvtier.fidelity.measure (prefix stored through a kvtierd
started here and loaded back: the CPU codec on a CPU, the GPU encode/decode on
a CUDA device) and kvtier.fidelity.classify. Writes the results JSON
(models -> path, texts, codecs; classifier -> recommended_codec, ratio) and
prints a Markdown table per model.

    python3 bench/fidelity_bench.py --kvtierd build/server/kvtierd \\
        --models build/models --out bench/results/cpu-2026-11-27-fidelity.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

import kvtier  # noqa: E402
from e2e_prefix_reuse import Daemon  # noqa: E402
from kvtier import fidelity  # noqa: E402

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def table(name: str, result: dict) -> str:
    rows = [f"### {name} ({result['device']})", "",
            "| codec | bytes/token | KL (nats) | top-1 | ppl | ppl 16-bit | greedy match |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for codec, s in result["codecs"].items():
        rows.append(f"| {codec} | {s['bytes_per_token']:.0f} | {s['kl']:.5f} | {s['top1']:.4f} "
                    f"| {s['ppl']:.3f} | {s['ppl_16bit']:.3f} | {s['greedy_match']} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvtierd", required=True)
    p.add_argument("--models", required=True, help="folder of <model>.gguf (scripts/fetch-models)")
    p.add_argument("--model", action="append", help=f"models to run (default: {MODELS})")
    p.add_argument("--texts", default=os.path.join(HERE, "fidelity"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefix-tokens", type=int, default=384)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8, help="the classifier's random prompts")
    p.add_argument("--machine", default="", help="machine name in the JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    texts = {}
    for f in sorted(os.listdir(args.texts)):
        if f.endswith(".txt"):
            with open(os.path.join(args.texts, f), encoding="utf-8") as fh:
                texts[f[:-4]] = fh.read()
    out = {"device": device_name(args.device), "machine": args.machine,
           "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "library_has_cuda": kvtier.has_cuda(), "prefix_tokens": args.prefix_tokens,
           "texts": {k: {"words": len(v.split())} for k, v in texts.items()},
           "text_notes": {"seen_public_domain": "the Gettysburg Address and the Declaration of "
                          "Independence's opening (in every model's training data)",
                          "unseen_2026": "prose written for kvtier in November 2026, after "
                          "every model here was trained"},
           "models": {}, "classifier": {}}
    with tempfile.TemporaryDirectory() as where:
        daemon = Daemon(args.kvtierd, where, dram_gib=4, nvme_gib=0)
        daemon.start()
        try:
            with kvtier.Client(socket=daemon.socket) as client:
                for key in args.model or MODELS:
                    path = os.path.join(args.models, f"{key}.gguf")
                    t = time.monotonic()
                    model, tokenizer = fidelity.load_model(path, device=args.device)
                    load_s = time.monotonic() - t
                    log(f"{key}: loaded in {load_s:.1f} s")
                    result = fidelity.measure(model, tokenizer, client, texts,
                                              prefix_tokens=args.prefix_tokens,
                                              greedy_tokens=args.greedy_tokens, model_id=key)
                    result["load_seconds"] = load_s
                    out["models"][key] = result
                    log(table(key, result))
                    out["classifier"][key] = fidelity.classify(model, prompts=args.prompts)
                    log(f"{key}: classifier {json.dumps(out['classifier'][key])}")
                    del model
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
        finally:
            daemon.stop()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for key, result in out["models"].items():
        print(table(key, result) + "\n")
        c = out["classifier"][key]
        print(f"classifier: {c['recommended_codec']} (ratio {c['ratio']:.2f}, {c['seconds']:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

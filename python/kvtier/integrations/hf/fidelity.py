"""What a kvtier codec does to a real model's output, measured through kvtierd.

Two measurements over a transformers causal LM (a directory or a GGUF file):

``measure``: a text's first ``prefix_tokens`` tokens are run by the model,
their KV is stored through kvtierd under each codec (kvtier.hf: the CPU codec
for a CPU model, the GPU encode/decode for a CUDA one), loaded back into a
fresh cache, and the rest of the text is run over the loaded prefix. The
result is scored against the same computation over the model's own 16-bit
prefix (no kvtier):

- ``kl``: mean KL(p_16bit || p_codec) over the continuation's positions, nats;
- ``top1``: fraction of positions whose most likely next token is the same;
- ``ppl`` / ``ppl_16bit``: the continuation's perplexity with either cache;
- ``greedy_match``: greedy tokens generated after the prefix (and the
  continuation's first token) that agree before the first divergence;
- ``bit_identical``: the continuation's logits are equal bit for bit.

``classify``: the ratio classifier. On random token prompts, the prefix's keys
(then its values) are quantized to symmetric INTb with one scale per group of
32 channels of a (token, head), b = 8 and 6; the suffix is run over each and
its logits compared with the 16-bit run's (mean absolute difference). The
ratio is key error / value error at the same bits, averaged (geometric mean)
over the bit widths. A ratio above 3 says the keys are the sensitive half:
keep them at 16 bits (k16v8); otherwise 8-bit keys cost about what 8-bit
values do (k8v8 halves the keys' bytes too).

Judge by KL and greedy agreement, not perplexity alone: a codec's noise on a
stored prefix can lower perplexity while KL grows by orders of magnitude.

    python -m kvtier.fidelity measure MODEL.gguf --socket ./kvtier-data/kvtierd.sock \\
        --text a.txt --text b.txt --json out.json
    python -m kvtier.fidelity classify MODEL.gguf
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

import kvtier
from kvtier.integrations.hf.prefix import PrefixReuse

#: Codecs measured by default: the names results use, and the kvtier codec of each.
#: fp8_symmetric (K and V in FP8 e4m3, one scale per layer) is the reference failure.
CODECS: dict[str, str] = {
    "k16v16": "k16v16",
    "k16v8": "k16v8",
    "k16vi8": "k16vi8",
    "k16v4": "k16v4",
    "k8v8": "k8v8",
    "fp8_symmetric": "k=fp8e4m3/tensor,v=fp8e4m3/tensor",
}

CLASSIFIER_THRESHOLD = 3.0


def load_model(path: str, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """(model, tokenizer) of a transformers model directory or a GGUF file.

    A GGUF is dequantized by transformers (needs the ``gguf`` package); the
    model runs in ``dtype`` (BF16 or FP16: kvtier.hf stores 16-bit KV).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model at {path}")
    kwargs = {}
    where = path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path} is a file but not a GGUF; pass a model directory or a .gguf")
        where, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs)
    # transformers types its wrapped PreTrainedModel.to as a plain function (self unbound).
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]


def model_name(path: str) -> str:
    """A model's name in results: the GGUF's or the directory's base name."""
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


# ---- scores -------------------------------------------------------------------


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def compare_logits(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """Scores of logits ``got`` [positions, vocab] against ``ref``.

    targets: the tokens that follow each position but the last ([positions - 1]),
    for perplexity.
    """
    lp, lq = _log_probs(ref), _log_probs(got)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()

    def ppl(logp):
        nll = -logp[:-1].gather(-1, targets.view(-1, 1)).mean().item()
        return math.exp(nll)

    return {"kl": max(kl, 0.0), "top1": top1, "ppl": ppl(lq), "ppl_16bit": ppl(lp),
            "max_abs_logit_diff": (ref - got).abs().max().item(),
            "bit_identical": bool(torch.equal(ref, got))}


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading elements on which a and b agree."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- measure --------------------------------------------------------------------


class _Run:
    """One model's runs over one text's prefix and continuation."""

    def __init__(self, model, ids: torch.Tensor, prefix_tokens: int, greedy_tokens: int):
        self.model = model
        self.device = next(model.parameters()).device
        self.ids = ids.to(self.device)
        self.prefix_tokens = prefix_tokens
        self.greedy_tokens = greedy_tokens
        with torch.no_grad():
            self.prefix_cache = model(self.ids[:, :prefix_tokens], use_cache=True).past_key_values

    @torch.no_grad()
    def continuation(self, cache) -> torch.Tensor:
        """Logits [continuation, vocab] (float32, CPU) of the text after the prefix."""
        out = self.model(self.ids[:, self.prefix_tokens:], past_key_values=cache, use_cache=True)
        return out.logits[0].float().cpu()

    @torch.no_grad()
    def greedy(self, cache) -> list[int]:
        """Greedy tokens after the prefix and the continuation's first token."""
        token = self.ids[:, self.prefix_tokens:self.prefix_tokens + 1]
        out = []
        for _ in range(self.greedy_tokens):
            logits = self.model(token, past_key_values=cache, use_cache=True).logits[0, -1]
            token = logits.argmax().view(1, 1)
            out.append(int(token))
        return out

    def own_cache(self):
        return copy.deepcopy(self.prefix_cache)


def measure_text(model, client: kvtier.Client, ids: torch.Tensor, *, prefix_tokens: int,
                 codecs: dict[str, str], chunk_tokens: int = 128, greedy_tokens: int = 32,
                 model_id: str = "", revision: str = "") -> dict:
    """Scores of each codec on one text (token ids [1, n]); see the module doc.

    The prefix (prefix_tokens, a multiple of chunk_tokens) is stored through
    ``client`` under each codec and loaded back; a prefix that does not come
    back whole raises RuntimeError (kvtierd too small, or a chunk lost).
    """
    if prefix_tokens <= 0 or prefix_tokens % chunk_tokens:
        raise ValueError(f"prefix_tokens {prefix_tokens} must be a positive multiple of "
                         f"chunk_tokens {chunk_tokens}")
    if ids.shape[1] < prefix_tokens + 2:
        raise ValueError(f"the text has {ids.shape[1]} tokens; it needs more than the prefix's "
                         f"{prefix_tokens} + 1")
    run = _Run(model, ids, prefix_tokens, greedy_tokens)
    ref = run.continuation(run.own_cache())
    ref_greedy = run.greedy(run.own_cache())
    targets = ids[0, prefix_tokens + 1:].cpu()
    result: dict[str, Any] = {"tokens": int(ids.shape[1]), "prefix_tokens": prefix_tokens,
                              "continuation_tokens": int(ids.shape[1]) - prefix_tokens,
                              "greedy_tokens": greedy_tokens, "codecs": {}}
    chunks = prefix_tokens // chunk_tokens

    def fetch(reuse: PrefixReuse, name: str):
        fetched = reuse.fetch(ids, max_chunks=chunks)
        if fetched.tokens != prefix_tokens:
            raise RuntimeError(f"{name}: kvtierd gave back {fetched.tokens} of the prefix's "
                               f"{prefix_tokens} tokens (tiers {fetched.tiers})")
        return fetched

    for name, codec in codecs.items():
        reuse = PrefixReuse(model, client, codec=codec, chunk_tokens=chunk_tokens,
                            model_id=model_id or None, revision=revision)
        reuse.store(ids[:, :prefix_tokens], run.own_cache())
        with client.get(reuse.keys(ids[:, :prefix_tokens])[0]) as chunk:
            info = kvtier.codec.read_header(chunk.data)
        fetched = fetch(reuse, name)
        scores = compare_logits(ref, run.continuation(fetched.cache), targets)
        got_greedy = run.greedy(fetch(reuse, name).cache)
        scores.update(greedy_match=matching_prefix(ref_greedy, got_greedy),
                      chunk_codec=info.codec, bytes_per_token=info.total_bytes / chunk_tokens,
                      tiers=sorted(set(fetched.tiers)))
        result["codecs"][name] = scores
    return result


def measure(model, tokenizer, client: kvtier.Client, texts: dict[str, str], *,
            prefix_tokens: int = 512, codecs: dict[str, str] | None = None,
            chunk_tokens: int = 128, greedy_tokens: int = 32, model_id: str = "",
            max_tokens: int | None = None) -> dict:
    """measure_text over named texts; adds ``path``: "kvtier" and the device."""
    codecs = dict(CODECS if codecs is None else codecs)
    out: dict[str, Any] = {"path": "kvtier", "device": str(next(model.parameters()).device),
                           "chunk_tokens": chunk_tokens, "texts": {}}
    for text_name, text in texts.items():
        ids = tokenizer(text, return_tensors="pt").input_ids
        if max_tokens:
            ids = ids[:, :max_tokens]
        out["texts"][text_name] = measure_text(
            model, client, ids, prefix_tokens=prefix_tokens, codecs=codecs,
            chunk_tokens=chunk_tokens, greedy_tokens=greedy_tokens, model_id=model_id)
    out["codecs"] = summarize(out["texts"])
    return out


def summarize(texts: dict) -> dict:
    """Per codec, the mean over texts of kl / top1 / ppl / ppl_16bit and the
    minimum greedy match; bit_identical only if it held on every text."""
    names = next(iter(texts.values()))["codecs"].keys()
    summary = {}
    for name in names:
        rows = [t["codecs"][name] for t in texts.values()]
        summary[name] = {k: sum(r[k] for r in rows) / len(rows)
                         for k in ("kl", "top1", "ppl", "ppl_16bit", "bytes_per_token")}
        summary[name]["greedy_match"] = min(r["greedy_match"] for r in rows)
        summary[name]["bit_identical"] = all(r["bit_identical"] for r in rows)
        summary[name]["chunk_codec"] = rows[0]["chunk_codec"]
    return summary


# ---- classify -------------------------------------------------------------------


def fake_quantize(x: torch.Tensor, bits: int, group: int = 32) -> torch.Tensor:
    """x quantized to symmetric INT``bits`` and back, one scale per ``group``
    consecutive channels of the last dimension (which group must divide)."""
    if x.shape[-1] % group:
        raise ValueError(f"the last dimension {x.shape[-1]} is not a multiple of group {group}")
    qmax = (1 << (bits - 1)) - 1
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / qmax
    q = torch.round(g / scale).clamp(-qmax, qmax) * scale
    return q.reshape(x.shape).to(x.dtype)


def _quantized_cache(cache, part: str, bits: int, group: int):
    out = copy.deepcopy(cache)
    for layer in out.layers:
        if part == "keys":
            layer.keys = fake_quantize(layer.keys, bits, group)
        else:
            layer.values = fake_quantize(layer.values, bits, group)
    return out


@torch.no_grad()
def classify(model, *, prompts: int = 8, prefix_tokens: int = 512, suffix_tokens: int = 32,
             group: int = 32, bits: Iterable[int] = (8, 6),
             threshold: float = CLASSIFIER_THRESHOLD, seed: int = 0) -> dict:
    """The ratio classifier (see the module doc): which codec fits this model.

    Returns recommended_codec ("k16v8" if the ratio exceeds ``threshold``, else
    "k8v8"), ratio, and the evidence: per bit width the mean absolute logit
    difference with quantized keys and with quantized values, and their ratio.
    """
    bits = tuple(bits)
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(seed)
    err = {(part, b): 0.0 for part in ("keys", "values") for b in bits}
    started = time.monotonic()
    for _ in range(prompts):
        ids = torch.randint(0, vocab, (1, prefix_tokens + suffix_tokens), generator=gen).to(device)
        cache = model(ids[:, :prefix_tokens], use_cache=True).past_key_values
        suffix = ids[:, prefix_tokens:]
        ref = model(suffix, past_key_values=copy.deepcopy(cache)).logits.float()
        for (part, b) in err:
            got = model(suffix, past_key_values=_quantized_cache(cache, part, b, group)).logits
            err[(part, b)] += (got.float() - ref).abs().mean().item() / prompts
    per_bits = {}
    for b in bits:
        k_err, v_err = err[("keys", b)], err[("values", b)]
        per_bits[f"int{b}"] = {"key_logit_diff": k_err, "value_logit_diff": v_err,
                               "ratio": k_err / max(v_err, 1e-30)}
    ratio = math.exp(sum(math.log(max(p["ratio"], 1e-30)) for p in per_bits.values())
                     / len(per_bits))
    return {"recommended_codec": "k16v8" if ratio > threshold else "k8v8", "ratio": ratio,
            "threshold": threshold, "evidence": per_bits, "prompts": prompts,
            "prefix_tokens": prefix_tokens, "suffix_tokens": suffix_tokens, "group": group,
            "seconds": time.monotonic() - started, "device": str(device)}


# ---- command line -----------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(prog="kvtier-fidelity", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="KL / top-1 / perplexity of each codec through kvtierd")
    m.add_argument("model", help="a transformers model directory or a .gguf file")
    m.add_argument("--socket", required=True, help="kvtierd's Unix socket")
    m.add_argument("--text", action="append", required=True, help="a text file (repeatable)")
    m.add_argument("--codec", action="append",
                   help=f"name=CODEC or a name of {sorted(CODECS)} (default: all of those)")
    m.add_argument("--prefix-tokens", type=int, default=512)
    m.add_argument("--chunk-tokens", type=int, default=128)
    m.add_argument("--greedy-tokens", type=int, default=32)
    m.add_argument("--max-tokens", type=int, default=0, help="cut each text to this many tokens")
    c = sub.add_parser("classify", help="recommend a codec from the key/value sensitivity ratio")
    c.add_argument("model", help="a transformers model directory or a .gguf file")
    c.add_argument("--prompts", type=int, default=8)
    c.add_argument("--prefix-tokens", type=int, default=512)
    c.add_argument("--threshold", type=float, default=CLASSIFIER_THRESHOLD)
    for sp in (m, c):
        sp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        sp.add_argument("--json", help="also write the result to this file")
    return p.parse_args(argv)


def _codecs_of(args) -> dict[str, str]:
    if not args.codec:
        return dict(CODECS)
    out = {}
    for item in args.codec:
        name, _, codec = item.partition("=")
        if not codec and name not in CODECS:
            raise SystemExit(f"kvtier-fidelity: unknown codec name {name!r}; write NAME=CODEC")
        out[name] = codec or CODECS[name]
    return out


def main(argv=None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    model, tokenizer = load_model(args.model, device=args.device)
    loaded_s = time.monotonic() - started
    name = model_name(args.model)
    if args.command == "classify":
        result = classify(model, prompts=args.prompts, prefix_tokens=args.prefix_tokens,
                          threshold=args.threshold)
    else:
        texts = {}
        for path in args.text:
            with open(path, encoding="utf-8") as f:
                texts[os.path.splitext(os.path.basename(path))[0]] = f.read()
        with kvtier.Client(socket=args.socket) as client:
            result = measure(model, tokenizer, client, texts, prefix_tokens=args.prefix_tokens,
                             codecs=_codecs_of(args), chunk_tokens=args.chunk_tokens,
                             greedy_tokens=args.greedy_tokens, model_id=name,
                             max_tokens=args.max_tokens or None)
    result = {"model": name, "load_seconds": loaded_s, **result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


__all__ = ["CODECS", "CLASSIFIER_THRESHOLD", "load_model", "model_name", "compare_logits",
           "matching_prefix", "measure_text", "measure", "summarize", "fake_quantize", "classify",
           "main"]


if __name__ == "__main__":
    sys.exit(main())

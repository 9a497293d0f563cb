#!/usr/bin/env python3
"""TTFT CDF plot (SVG) of a vllm_bench.py results JSON: one panel per pass
(cold: every peer stores; warm: every peer loads), one line per peer; of a
vllm_serve_bench.py results JSON: one panel, every request of the workload.

  python3 bench/engines/ttft_cdf.py RESULTS.json [OUT.svg]

Plain SVG, no plotting library: the results are small (one point a request).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COLORS = {"no_connector": "#555555", "offloading": "#8c6d31", "lmcache": "#d62728",
          "kvtier_k16v16": "#1f77b4", "kvtier_k16v8": "#2ca02c",
          "kvtier_k16v8_zerocopy": "#9467bd", "kvtier_k16v8_seal4": "#17becf",
          "kvtier_k16v8_nice0": "#bcbd22", "kvtier_k16v8_nice10": "#bcbd22",
          "kvtier_k16v8_twoengines": "#e377c2", "kvtier_k16v8_pieces": "#ff7f0e",
          "kvtier_k16v8_stagedload": "#7f7f7f", "kvtier_k16v8_savelate": "#ff7f0e"}
PANEL_W, PANEL_H, MARGIN = 420, 260, 50


def panel(x0: float, title: str, series: dict[str, list[float]]) -> list[str]:
    values = [v for vs in series.values() for v in vs]
    hi = max(values) * 1.05 if values else 1.0
    out = [f'<text x="{x0 + PANEL_W / 2}" y="20" text-anchor="middle" '
           f'font-size="14">{title}</text>',
           f'<rect x="{x0}" y="{MARGIN - 20}" width="{PANEL_W}" height="{PANEL_H}" '
           'fill="none" stroke="#999"/>']
    def px(v: float) -> float:
        return x0 + PANEL_W * v / hi
    def py(q: float) -> float:
        return MARGIN - 20 + PANEL_H * (1 - q)
    for i in range(6):
        v = hi * i / 5
        out.append(f'<text x="{px(v):.1f}" y="{MARGIN + PANEL_H - 4}" font-size="10" '
                   f'text-anchor="middle">{v:.0f}</text>')
        q = i / 5
        out.append(f'<text x="{x0 - 4}" y="{py(q) + 3:.1f}" font-size="10" '
                   f'text-anchor="end">{q:.1f}</text>')
    out.append(f'<text x="{x0 + PANEL_W / 2}" y="{MARGIN + PANEL_H + 10}" font-size="11" '
               'text-anchor="middle">TTFT (ms)</text>')
    for row, (name, vs) in enumerate(series.items()):
        s = sorted(vs)
        points = [(px(0), py(0))]
        for i, v in enumerate(s):
            points += [(px(v), py(i / len(s))), (px(v), py((i + 1) / len(s)))]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        color = COLORS.get(name, "#000000")
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" '
                   f'points="{path}"/>')
        out.append(f'<text x="{x0 + PANEL_W - 6}" y="{MARGIN + 14 * row:.0f}" '
                   f'font-size="11" text-anchor="end" fill="{color}">{name}</text>')
    return out


def render(results: dict) -> str:
    peers = {k: v for k, v in results["peers"].items() if "error" not in v}
    width = 2 * PANEL_W + 3 * MARGIN
    height = PANEL_H + 2 * MARGIN
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif">',
            f'<rect width="{width}" height="{height}" fill="white"/>']
    w = results["workload"]
    if "sglang_version" in results:  # sglang_bench.py: multi-turn conversations
        caption = (f'{results["device"]}, SGLang {results["sglang_version"]} HiCache, '
                   f'{w["clients"]} conversations x {w["rounds"]} rounds')
        body.append(f'<text x="{width / 2}" y="{height - 6}" font-size="11" '
                    f'text-anchor="middle">{caption}</text>')
        body += panel(MARGIN, "multi-turn, every request",
                      {k: p["ttfts_ms"] for k, p in peers.items()})
        body.append("</svg>")
        return "\n".join(body) + "\n"
    mode = "compiled" if next(iter(peers.values()))["compiled"] else "eager"
    serve = isinstance(w, dict) and "num_prompts" in w
    if serve:
        caption = (f'{results["device"]}, vLLM {results["vllm_version"]}, vllm bench serve '
                   f'{w["workload"]}, {mode}')
    else:
        caption = (f'{results["device"]}, vLLM {results["vllm_version"]}, {w["docs"]} x '
                   f'{w["doc_tokens"]} tokens, {mode}')
    body.append(f'<text x="{width / 2}" y="{height - 6}" font-size="11" '
                f'text-anchor="middle">{caption}</text>')
    if serve:
        body += panel(MARGIN, f'{w["workload"]}, every request',
                      {k: p["ttfts_ms"] for k, p in peers.items()})
    else:
        body += panel(MARGIN, "cold pass (stores)",
                      {k: p["cold_ttft_ms"] for k, p in peers.items()})
        body += panel(2 * MARGIN + PANEL_W, "warm pass (loads)",
                      {k: p["warm_ttft_ms"] for k, p in peers.items()})
    body.append("</svg>")
    return "\n".join(body) + "\n"


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    src = Path(sys.argv[1])
    dst = Path(sys.argv[2]) if len(sys.argv) == 3 else src.with_suffix(".svg")
    dst.write_text(render(json.loads(src.read_text())))
    print(dst)


if __name__ == "__main__":
    main()

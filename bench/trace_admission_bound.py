#!/usr/bin/env python3
"""How far admission can lift a DRAM-only cache on a Mooncake-format trace.

An offline analysis beside `kvtier replay` (which drives the real placement
engine): the same request model (a request reads its blocks in order; the
longest cached prefix hits; every block past it is stored), over one cache of
N blocks with priority eviction, so that admission rules which need knowledge
no online cache has can be measured:

  lru             every block admitted, least recently used evicted (checks
                  the model: it must match `kvtier replay --policy lru`)
  full-only       LRU that does not store a request's partial last block
  freq            LRU priority plus a bonus of 0.5 x capacity per extra use
                  (up to 3), as FLRU's middle setting; with full-only
  class-oracle    freq + full-only, and a new block is admitted only if its
                  feature class (continuation or not, share of the request
                  that hit, distance from the request's end) has a reuse
                  rate >= the threshold, the rates measured on the whole trace
                  itself: an optimistic bound for any admission rule built on
                  those request-level features
  reuse-oracle    LRU that stores a new block only if a later request reads
                  it: perfect knowledge of which blocks are reused (not of
                  when, which Belady also has)

Usage: bench/trace_admission_bound.py TRACE.jsonl [--shares 0.02,0.05,0.1,0.2]
       [--json OUT.json]
"""
import argparse
import collections
import heapq
import json
import math


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(reqs, capacity, admit, bonus=0.0):
    """Prefix hits / block reads of a priority cache of `capacity` blocks."""
    prio, heap = {}, []
    uses = collections.Counter()
    hits = reads = t = 0
    for r in reqs:
        ids = r["hash_ids"]
        k = 0
        while k < len(ids) and ids[k] in prio:
            k += 1
        hits += k
        reads += len(ids)
        for i, h in enumerate(ids):
            t += 1
            uses[h] += 1
            if h not in prio:
                if not admit(r, i, k):
                    continue
                if len(prio) >= capacity:
                    while True:
                        p, victim = heapq.heappop(heap)
                        if prio.get(victim) == p:
                            del prio[victim]
                            break
            p = t + bonus * capacity * min(uses[h] - 1, 3)
            prio[h] = p
            heapq.heappush(heap, (p, h))
    return hits / reads


def feature_class(r, i, hit):
    n_full = r["input_length"] // 512
    if i >= n_full:
        return ("partial",)
    return (hit > 1, min(3, 4 * hit // len(r["hash_ids"])), min(3, n_full - 1 - i))


def class_rates(reqs):
    reads = collections.Counter(h for r in reqs for h in r["hash_ids"])
    seen, stats = set(), collections.defaultdict(lambda: [0, 0])
    for r in reqs:
        ids = r["hash_ids"]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        for i, h in enumerate(ids):
            if h in seen:
                continue
            seen.add(h)
            s = stats[feature_class(r, i, k)]
            s[0] += 1
            s[1] += reads[h] > 1
    return {c: s[1] / s[0] for c, s in stats.items()}, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--shares", default="0.01,0.02,0.05,0.1,0.2,0.4")
    ap.add_argument("--json")
    a = ap.parse_args()
    reqs = load(a.trace)
    if not reqs or any("hash_ids" not in r or "input_length" not in r for r in reqs):
        raise SystemExit(f"{a.trace}: not a Mooncake-format trace (hash_ids, input_length)")
    distinct = len({h for r in reqs for h in r["hash_ids"]})
    rates, stats = class_rates(reqs)
    reads = collections.Counter(h for r in reqs for h in r["hash_ids"])
    full_only = lambda r, i, hit: i < r["input_length"] // 512
    out = {"trace": a.trace, "requests": len(reqs), "distinct_blocks": distinct,
           "class_reuse_rates": {str(c): {"new_blocks": stats[c][0], "reused": round(rates[c], 4)}
                                 for c in sorted(rates, key=str)},
           "rows": []}
    print(f"{len(reqs)} requests, {distinct} distinct blocks; prefix hit ratio per cache share")
    print("share   lru     full-only freq    freq+full class-oracle(best) reuse-oracle")
    for share in (float(s) for s in a.shares.split(",")):
        cap = max(1, math.ceil(share * distinct))
        row = {"share": share, "capacity_blocks": cap,
               "lru": run(reqs, cap, lambda r, i, k: True),
               "full_only": run(reqs, cap, full_only),
               "freq": run(reqs, cap, lambda r, i, k: True, bonus=0.5),
               "freq_full_only": run(reqs, cap, full_only, bonus=0.5)}
        best = (0.0, None)
        for th in (0.05, 0.1, 0.15, 0.2, 0.25):
            v = run(reqs, cap, lambda r, i, k, th=th: rates[feature_class(r, i, k)] >= th, bonus=0.5)
            best = max(best, (v, th))
        row["class_oracle"], row["class_oracle_threshold"] = best
        row["reuse_oracle"] = run(
            reqs, cap, lambda r, i, k: reads[r["hash_ids"][i]] > 1 or i < k)
        out["rows"].append(row)
        print(f"{share:<7} {row['lru']:.4f}  {row['full_only']:.4f}    {row['freq']:.4f}  "
              f"{row['freq_full_only']:.4f}    {row['class_oracle']:.4f} (th {best[1]})     "
              f"{row['reuse_oracle']:.4f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

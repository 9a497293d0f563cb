#!/usr/bin/env python3
"""Host-pool pages through kvtierd (SGLang HiCache's storage path): one batch of
Llama-3.1-8B pages (32 layers, 8 kv heads, head_dim 128, 64 tokens, BF16) in
SGLang's page_first host layout, stored and loaded with Client.put_pages /
get_pages (one native call a batch, pages on THREADS threads outside the
interpreter lock), against torch's copy of the same 16-bit bytes between two
host tensors (the page's KV, the same rows, in this run), and against the
per-page Python path the SGLang backend used before (client.get + decode_chunk +
a strided copy_, pages on a ThreadPoolExecutor of THREADS).

Each path is measured alone and beside a Python thread that keeps the
interpreter busy, as SGLang's scheduler loop does in the process where its
HiCache storage backend runs.

Usage: host_pages_bench.py SOCKET OUT.json [--pages N] [--threads T]
(libkvtier: $KVTIER_LIBRARY or the build)
"""
import argparse
import concurrent.futures
import json
import pathlib
import platform
import sys
import threading
import time

import torch

_here = pathlib.Path(__file__).resolve().parent
_package = _here / "python" if (_here / "python").is_dir() else _here.parent / "python"
sys.path.insert(0, str(_package))
import kvtier  # noqa: E402
import kvtier.codec  # noqa: E402
import kvtier.torch  # noqa: E402

L, H, D, PS = 32, 8, 128, 64


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


class Busy:
    """A Python thread that holds the interpreter lock in a loop."""

    def __init__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        x = 0
        while not self.stop.is_set():
            for i in range(1000):
                x += i

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("out")
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n, threads = a.pages, a.threads
    client = kvtier.Client(socket=a.socket, max_data_connections=max(4, threads))
    fp = kvtier.ModelIdentity("bench/host-pages", codec="k16v8").fingerprint()
    g = torch.Generator().manual_seed(1)
    # SGLang's page_first host pool: [2, tokens, layers, heads, dim].
    src = torch.randn((2, n * PS, L, H, D), generator=g).to(torch.bfloat16)
    dst = torch.zeros_like(src)

    def page(buf, i):
        tokens = slice(i * PS, (i + 1) * PS)
        return buf[0, tokens].transpose(0, 1), buf[1, tokens].transpose(0, 1)

    kv16 = 2 * L * PS * H * D * 2  # bytes of one page's K and V
    results = {"device": platform.processor() or platform.machine(),
               "cpus": torch.get_num_threads(),
               "page": {"layers": L, "kv_heads": H, "head_dim": D, "tokens": PS, "dtype": "bf16",
                        "host_layout": "page_first"},
               "pages": n, "threads": threads, "codecs": {}}

    def timed(fn):
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return median(times)

    def copy_all():
        dst.copy_(src)

    for ci, codec in enumerate(["k16v16", "k16v8"]):
        spec = kvtier.codec.ChunkSpec(fp, L, H, D, PS, PS, "bf16", codec)
        keys = [kvtier.chunk_keys(fp, [ci, i] * 32, chunk_tokens=64)[0] for i in range(n)]
        src_pages = [kvtier.HostPage.of(*page(src, i)) for i in range(n)]
        dst_pages = [kvtier.HostPage.of(*page(dst, i)) for i in range(n)]

        def put(spec=spec, keys=keys, src_pages=src_pages):
            r = client.put_pages(spec, keys, src_pages, threads=threads)
            assert all(e is None for e in r.errors), r.errors[:2]

        def get(spec=spec, keys=keys, dst_pages=dst_pages):
            r = client.get_pages(spec, keys, dst_pages, threads=threads)
            assert all(e is None for e in r.errors), r.errors[:2]

        pool = concurrent.futures.ThreadPoolExecutor(threads)

        def get_one_python(i, keys=keys):
            k_view, v_view = page(dst, i)
            with client.get(keys[i]) as chunk:
                k, v = kvtier.torch.decode_chunk(chunk.data)
                k_view.copy_(k)
                v_view.copy_(v)

        def get_python(pool=pool, get_one_python=get_one_python):
            list(pool.map(get_one_python, range(n)))

        put()
        enc = len(client.get_bytes(keys[0]))
        r = {"encoded_bytes_per_page": enc, "kv16_bytes_per_page": kv16}
        for busy in (False, True):
            suffix = "_busy_interpreter" if busy else ""
            ctx = Busy() if busy else None
            if ctx:
                ctx.__enter__()
            try:
                base = timed(copy_all)
                for name, fn in (("put_pages", put), ("get_pages", get),
                                 ("get_per_page_python", get_python)):
                    t = timed(fn)
                    r[name + suffix] = {"s_per_batch": t, "kv16_GBps": n * kv16 / t / 1e9,
                                        "vs_host_copy": base / t}
                r["host_copy" + suffix] = {"s_per_batch": base, "kv16_GBps": n * kv16 / base / 1e9}
            finally:
                if ctx:
                    ctx.__exit__(None, None, None)
        dst.zero_()
        get()
        if codec == "k16v16":
            assert torch.equal(dst, src), "k16v16 pages did not round-trip"
        pool.shutdown()
        for k in keys:
            client.delete(k)
        results["codecs"][codec] = r
        for name, e in r.items():
            if isinstance(e, dict):
                ratio = f"  {e['vs_host_copy']:.2f} of a host copy" if "vs_host_copy" in e else ""
                print(f"{codec:7s} {name:36s} {e['kv16_GBps']:6.2f} GB/s kv16{ratio}", flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    client.close()


if __name__ == "__main__":
    main()

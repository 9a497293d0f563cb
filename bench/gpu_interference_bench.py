#!/usr/bin/env python3
"""What a store in flight costs an engine's decode step on the same GPU, part
by part, without an engine.

Inside vLLM the decode steps that run while a request's chunks are stored
lose 16-38 ms a request (bench/results/vllm-gpu.md). This bench rebuilds the
two sides in one process against a running kvtierd and times the step alone,
then beside each background load in turn, so that one run says which part of
a store costs the step:

  step         a decode-like step: a CUDA graph of Llama-3.1-8B-sized MLP
               weights at batch 1 (32 layers of 4096x14336 and 14336x4096
               BF16 matmuls: the weights stream from HBM as in a decode),
               then the sampled token's copy to pinned host memory and a
               host sync, as vLLM's runner ends each step
  store        kvtier.torch.store_batch of 32 k16v8 chunks of 256 tokens
               (one 8K-token request), again and again: the connector's saver
  encode_copy  the same chunks encoded and copied into kvtierd's pool, then
               released uncommitted: the GPU's part of a store, no sealing
  encode_only  the encode of all but the last layer of each chunk into the
               store's device buffer (no copy: a store copies after its last
               layer), released uncommitted: the SMs' part of a store
  copy_only    cudaMemcpyAsync of 32 chunks' bytes from device memory into
               pinned host memory on a side stream, all queued at once: the
               copy engine alone
  copy_depth3  the same copies with at most 3 chunks queued (what a
               store_batch queues, kStoreBatchDepth)
  copy_pieces  the same bytes in 4 MiB pieces with at most 2 pieces queued,
               the host issuing the next as one completes: how much of the
               copy-queue wait a paced copy would remove, and at what rate
  put_host     client.put of 32 k16v8 chunks already on the host (the
               client's copy into the pool and kvtierd's check of each):
               the host's part, no GPU work

Each background load runs on its own thread (its own CUDA stream) for as long
as the timed steps run. Reported per load: the step's mean, p50, p90 and max
in ms, the ratio of its mean to the step alone, and how many chunks the load
moved meanwhile. Device and the alone baseline are from the same run.

Usage: gpu_interference_bench.py SOCKET OUT.json [STEPS]
"""

import json
import pathlib
import statistics
import sys
import threading
import time

import torch

_here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_here / "python" if (_here / "python").is_dir() else _here.parent / "python"))
import kvtier  # noqa: E402
from gpu_daemon_bench import DEV, L, T, paged_cache  # noqa: E402
from kvtier.torch import _gpu as kg  # noqa: E402

HIDDEN, FFN = 4096, 14336
CHUNKS = 32


def key(tag: int, i: int) -> bytes:
    return bytes([0xB1, tag]) + i.to_bytes(14, "big")


def percentile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class DecodeStep:
    """One decode-like step: a captured graph over the MLP weights, then the
    token's copy to the host and a sync."""

    def __init__(self):
        g = torch.Generator(device=DEV).manual_seed(3)
        scale = 1.0 / (FFN ** 0.5)
        self.w1 = [torch.randn(HIDDEN, FFN, generator=g, device=DEV, dtype=torch.bfloat16) * scale
                   for _ in range(L)]
        self.w2 = [torch.randn(FFN, HIDDEN, generator=g, device=DEV, dtype=torch.bfloat16) * scale
                   for _ in range(L)]
        self.x = torch.randn(1, HIDDEN, generator=g, device=DEV, dtype=torch.bfloat16)
        self.token = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self.stream = torch.cuda.Stream(DEV)
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm up outside the capture
                self._forward()
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.out = self._forward()

    def _forward(self):
        h = self.x
        for w1, w2 in zip(self.w1, self.w2, strict=True):
            h = torch.nn.functional.silu(h @ w1) @ w2
        return h.argmax(dim=-1)

    def run(self) -> float:
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self.graph.replay()
            self.token.copy_(self.out, non_blocking=True)
        self.stream.synchronize()
        return time.perf_counter() - t0


class Background:
    """Runs `work(i)` on its own thread until stopped; counts chunks moved."""

    def __init__(self, work):
        self.work = work
        self.stop = threading.Event()
        self.chunks = 0
        self.error = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        i = 0
        try:
            while not self.stop.is_set():
                self.chunks += self.work(i)
                i += 1
        except Exception as e:  # noqa: BLE001 - reported in the results
            self.error = repr(e)

    def __enter__(self):
        self.thread.start()
        time.sleep(0.2)  # the load is running before the first timed step
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=120)


def main():
    sock, out_path = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    client = kvtier.Client(socket=sock)
    cache, ids = paged_cache(CHUNKS)
    step = DecodeStep()

    # Warm up the store path (slot, workspace and staging pools, the pool's
    # CUDA registration) and make the host chunks put_host stores.
    warm = [key(0xF0, i) for i in range(CHUNKS)]
    assert kg.store_batch(client, warm, cache, ids, codec="k16v8") == [None] * CHUNKS
    host_chunks = [client.get_bytes(k) for k in warm]
    for k in warm:
        client.delete(k)
    chunk_bytes = len(host_chunks[0])
    src = torch.empty(chunk_bytes, dtype=torch.uint8, device=DEV)
    pinned = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(CHUNKS)]

    saver = torch.cuda.Stream(DEV)  # the connector's saver stream

    def store(i):
        keys = [key(0x10, c) for c in range(CHUNKS)]
        errs = kg.store_batch(client, keys, cache, ids, codec="k16v8", stream=saver)
        for k in keys:
            try:
                client.delete(k)
            except kvtier.NotFound:
                pass
        return sum(e is None for e in errs)

    side = torch.cuda.Stream(DEV)

    def encode_copy(i):
        with torch.cuda.stream(side):
            for c in range(CHUNKS):
                op = kg.begin_store(client, cache, T, codec="k16v8")
                op.encode_layers(ids[c], None, stream=side)
                op.close()  # waits for the encode and the copy, aborts the slot
        return CHUNKS

    def copy_only(i):
        with torch.cuda.stream(side):
            for c in range(CHUNKS):
                pinned[c].copy_(src, non_blocking=True)
        side.synchronize()
        return CHUNKS

    def encode_only(i):
        with torch.cuda.stream(side):
            for c in range(CHUNKS):
                op = kg.begin_store(client, cache, T, codec="k16v8")
                op.encode_layers(ids[c], (0, L - 1), stream=side)
                op.close()  # waits for the encode, aborts the slot
        return CHUNKS

    def paced(pieces, depth):
        """Copies (src offset, length) `pieces` of every chunk, `depth` in flight."""
        def work(i):
            events = []
            with torch.cuda.stream(side):
                for c in range(CHUNKS):
                    for off, n in pieces:
                        if len(events) == depth:
                            events.pop(0).synchronize()
                        pinned[c][off:off + n].copy_(src[off:off + n], non_blocking=True)
                        ev = torch.cuda.Event(blocking=True)
                        ev.record(side)
                        events.append(ev)
            side.synchronize()
            return CHUNKS
        return work

    piece = 4 << 20
    whole = [(0, chunk_bytes)]
    in_pieces = [(o, min(piece, chunk_bytes - o)) for o in range(0, chunk_bytes, piece)]

    def put_host(i):
        for c in range(CHUNKS):
            k = key(0x20, c)
            client.put(k, host_chunks[c])
            client.delete(k)
        return CHUNKS

    loads = {"alone": None, "store": store, "encode_copy": encode_copy,
             "encode_only": encode_only, "copy_only": copy_only,
             "copy_depth3": paced(whole, 3), "copy_pieces": paced(in_pieces, 2),
             "put_host": put_host}
    for _ in range(50):
        step.run()
    results = {"device": torch.cuda.get_device_name(DEV), "steps": steps,
               "chunk_bytes": chunk_bytes, "chunks_per_round": CHUNKS,
               "step": f"CUDA graph of {L} x ({HIDDEN}x{FFN}, {FFN}x{HIDDEN}) BF16 matmuls at "
                       "batch 1, then the token's copy to pinned memory and a sync",
               "loads": {}}
    alone_mean = None
    # Each load twice, alone between them, so a drift over the run shows.
    for name in list(loads) + ["alone_again"]:
        work = loads.get(name)
        t_start = time.perf_counter()
        if work is None:
            times = [step.run() for _ in range(steps)]
            moved, error = 0, None
        else:
            with Background(work) as bg:
                times = [step.run() for _ in range(steps)]
            moved, error = bg.chunks, bg.error
        elapsed = time.perf_counter() - t_start
        ms = [1e3 * t for t in times]
        row = {"mean_ms": statistics.fmean(ms), "p50_ms": percentile(ms, 0.5),
               "p90_ms": percentile(ms, 0.9), "max_ms": max(ms),
               "chunks_moved": moved, "chunks_per_s": moved / elapsed,
               "GBps": moved * chunk_bytes / elapsed / 1e9}
        if error:
            row["error"] = error
        if alone_mean is None:
            alone_mean = row["mean_ms"]
        row["mean_vs_alone"] = row["mean_ms"] / alone_mean
        results["loads"][name] = row
        print(f"{name:12s} step mean {row['mean_ms']:7.3f} ms  p50 {row['p50_ms']:7.3f}  "
              f"p90 {row['p90_ms']:7.3f}  max {row['max_ms']:7.3f}  x{row['mean_vs_alone']:.3f}  "
              f"({moved} chunks, {row['GBps']:.1f} GB/s){'  ' + error if error else ''}",
              flush=True)
    client.close()
    pathlib.Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

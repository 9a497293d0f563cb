#!/usr/bin/env python3
"""Store and load of Llama-3.1-8B chunks between a paged GPU cache and a running
kvtierd (kvtier.torch._gpu over libkvtier), against a pinned cudaMemcpy of the
same encoded bytes measured in the same run.

Chunk: 32 layers, 8 kv heads, head_dim 128, 256 tokens; vLLM FlashAttention NHD
BF16 cache, block size 16. Single chunks (one call at a time) and batches of 32
(stores from STORE_THREADS threads on their own streams; loads as one layer-wise
batch, one group of all layers and groups of one layer).

Usage: gpu_daemon_bench.py SOCKET OUT.json [TRACE.json]   (libkvtier: $KVTIER_LIBRARY or
the build). With TRACE.json, single k16v8 stores and loads also run under
torch.profiler (CUDA runtime calls, copies and kernels of every library in the
process, each store and load a marked range) into that Chrome trace: where a
single chunk's time goes between the device's work.
load_single_host_check, load_batch_layerwise_*_host_check: loads whose
records the host hashes (KVTIER_GPU_VERIFY=host) instead of the device (for
layer-wise loads: the kernels read the pool, no staging).
store_single_engine_thread: what one store costs the calling thread when its
commit runs on another thread (begin_store's slot + the encode's enqueue), as
in the engine connectors.
Prints and writes GB/s of encoded bytes and of 16-bit KV, and
store_vs_pinned_memcpy / load_vs_pinned_memcpy (encoded GB/s over the pinned
copy's GB/s: device-to-host for stores, host-to-device for loads).
"""

import concurrent.futures
import json
import os
import pathlib
import sys
import time

import torch

# The package beside this script (the GPU bundle), else the repository's.
_here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_here / "python" if (_here / "python").is_dir() else _here.parent / "python"))
import kvtier  # noqa: E402
import kvtier.codec  # noqa: E402
from kvtier.torch import _gpu as kg  # noqa: E402

L, H, D, T, BS = 32, 8, 128, 256, 16
BATCH = 32
STORE_THREADS = 8  # concurrent stores of a batch, each on its own stream
KV16_BYTES = 2 * L * T * H * D * 2  # K and V, 16-bit
DEV = torch.device("cuda", 0)


def delete(client, keys):
    for k in keys:
        try:
            client.delete(k)
        except kvtier.NotFound:
            pass


def key(tag, i):
    return bytes([0xBE, tag]) + i.to_bytes(14, "big")


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def pinned_copy_s(nbytes, n, to_device):
    """Seconds of n pinned copies of nbytes each, one after another (median of 5 reps)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    host.fill_(1)
    times = []
    for rep in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            if to_device:
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - t0)
    return median(times)


def store_breakdown(client, cache, ids, codec, tag):
    """Milliseconds of each phase of one store (median of 10): the slot
    (begin_store: AllocateSlot), the encode's enqueue, the encode itself
    (the stream's sync), and the commit (RPC + the daemon's sealing pass)."""
    phases = {"begin": [], "enqueue": [], "encode": [], "commit": []}
    for i in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ps = kg.begin_store(client, cache, T, codec=codec)
        t1 = time.perf_counter()
        ps.encode_layers(ids[i % len(ids)], (0, L))
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        ps.commit(key(tag, 900 + i))
        t4 = time.perf_counter()
        for name, a, b in (("begin", t0, t1), ("enqueue", t1, t2), ("encode", t2, t3),
                           ("commit", t3, t4)):
            phases[name].append((b - a) * 1e3)
    delete(client, [key(tag, 900 + i) for i in range(10)])
    return {name: median(v) for name, v in phases.items()}


def trace_singles(client, cache, ids, path):
    """Six single k16v8 stores, then six single loads of them, then layer-wise loads of
    the six (groups of all layers and of one), under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function
    keys = [key(0x70, i) for i in range(6)]
    kg.store(client, keys[0], cache, ids[0], codec="k16v8")  # warm
    kg.load(client, keys[0], cache, ids[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i, k in enumerate(keys):
            with record_function(f"store {i}"):
                kg.store(client, k, cache, ids[i], codec="k16v8")
        for i, k in enumerate(keys):
            with record_function(f"load {i}"):
                kg.load(client, k, cache, ids[i])
        for group in (L, 1):
            with record_function(f"layerwise group {group}"):
                kg.load_layerwise(client, keys, cache, ids[:len(keys)], layer_group=group).finish()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    delete(client, keys)


def paged_cache(chunks):
    """A vLLM FlashAttention NHD BF16 cache of random KV with room for `chunks`
    chunks (the cache keeps its tensors), and each chunk's block ids."""
    nb = chunks * (T // BS) + 16
    g = torch.Generator(device=DEV).manual_seed(1)
    layers = [torch.randn((2, nb, BS, H, D), generator=g, device=DEV).to(torch.bfloat16)
              for _ in range(L)]
    ids = [list(range(i * (T // BS), (i + 1) * (T // BS))) for i in range(chunks)]
    return kg.PagedCache.from_vllm(layers, layout="flash_attn_nhd"), ids


def main():
    sock, out_path = sys.argv[1], sys.argv[2]
    # As many data-plane connections as concurrent stores.
    client = kvtier.Client(socket=sock, max_data_connections=STORE_THREADS)
    # A second client whose GPU handle checks loads on the host
    # (KVTIER_GPU_VERIFY=host, read when the handle opens): the single load's
    # baseline for the device check.
    host_check = kvtier.Client(socket=sock, max_data_connections=STORE_THREADS)
    os.environ["KVTIER_GPU_VERIFY"] = "host"
    try:
        kg.open_gpu(host_check, DEV)
    finally:
        del os.environ["KVTIER_GPU_VERIFY"]
    cache, ids = paged_cache(BATCH)
    results = {"device": torch.cuda.get_device_name(DEV), "model": "Llama-3.1-8B",
               "chunk": {"layers": L, "kv_heads": H, "head_dim": D, "tokens": T,
                         "block_size": BS, "cache": "vllm flash_attn NHD bf16"},
               "kv16_bytes_per_chunk": KV16_BYTES, "batch": BATCH, "codecs": {}}
    streams = [torch.cuda.Stream(DEV) for _ in range(STORE_THREADS)]
    for ci, codec in enumerate(["k16v8", "k16v16"]):
        tag = 0x10 * (ci + 1)
        # Warm up (slot and workspace pools, the first CUDA calls).
        for i in range(4):
            kg.store(client, key(tag, 1000 + i), cache, ids[i], codec=codec)
            kg.load(client, key(tag, 1000 + i), cache, ids[i])
        # The reader's check of a load (header + both section checksums, K and V
        # on two threads), on a private copy (bytes go to the C API in place):
        # what bounds one chunk's load.
        chunk_bytes = client.get_bytes(key(tag, 1000))
        kvtier.codec.inspect_chunk(chunk_bytes)
        t0 = time.perf_counter()
        for _ in range(5):
            kvtier.codec.inspect_chunk(chunk_bytes)
        verify_s = (time.perf_counter() - t0) / 5
        enc = len(chunk_bytes)
        delete(client, [key(tag, 1000 + i) for i in range(4)])
        # A load's fixed cost: one of a key that is not there (the block ids'
        # upload, the hold's round trip to kvtierd, the miss raised in Python).
        miss_s = []
        for i in range(21):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                kg.load(client, key(tag, 5000 + i), cache, ids[0])
            except kvtier.NotFound:
                pass
            miss_s.append(time.perf_counter() - t0)
        breakdown = store_breakdown(client, cache, ids, codec, tag + 3)
        print(f"{codec:7s} store phases (ms, median of 10): " +
              ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()), flush=True)

        reps = 3
        single_store, single_load, batch_store, batch_load, batch_load_l1 = [], [], [], [], []
        single_load_host, batch_load_host, batch_load_l1_host = [], [], []
        one_call = []
        engine_thread = []
        for rep in range(reps):
            keys = [key(tag, rep * 100 + i) for i in range(BATCH)]
            single_keys = [key(tag + 1, rep * 100 + i) for i in range(8)]
            # Single chunks: one store at a time.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(8):
                kg.store(client, single_keys[i], cache, ids[i], codec=codec)
            single_store.append((time.perf_counter() - t0) / 8)
            # The engine's thread with the commit on another thread (as the
            # connectors' saver does): begin (the slot) + the encode's enqueue.
            torch.cuda.synchronize()
            spent = 0.0
            eng_keys = [key(tag + 2, rep * 100 + i) for i in range(8)]
            with concurrent.futures.ThreadPoolExecutor(1) as saver:
                commits = []
                for i in range(8):
                    t0 = time.perf_counter()
                    ps = kg.begin_store(client, cache, T, codec=codec)
                    ps.encode_layers(ids[i], (0, L))
                    spent += time.perf_counter() - t0
                    commits.append(saver.submit(ps.commit, eng_keys[i]))
                    commits[-1].result()  # one chunk at a time, as single_store
            engine_thread.append(spent / 8)
            delete(client, eng_keys)
            # Batch: 32 stores from STORE_THREADS threads, each on its own stream.
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(STORE_THREADS) as ex:
                list(ex.map(lambda i: kg.store(client, keys[i], cache, ids[i], codec=codec,
                                               stream=streams[i % STORE_THREADS]), range(BATCH)))
            batch_store.append((time.perf_counter() - t0) / BATCH)
            # The connectors' saver: one store_batch of BATCH chunks from one
            # thread, on one stream.
            call_keys = [key(tag + 4, rep * 100 + i) for i in range(BATCH)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            errors = kg.store_batch(client, call_keys, cache, ids, codec=codec, stream=streams[0])
            one_call.append((time.perf_counter() - t0) / BATCH)
            assert all(e is None for e in errors), errors
            delete(client, call_keys)
            # Single loads.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(8):
                kg.load(client, single_keys[i], cache, ids[i])
            single_load.append((time.perf_counter() - t0) / 8)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(8):
                kg.load(host_check, single_keys[i], cache, ids[i])
            single_load_host.append((time.perf_counter() - t0) / 8)
            # Batch loads, layer-wise (one group of all layers, and groups of one layer).
            for who, group, acc in ((client, L, batch_load), (client, 1, batch_load_l1),
                                    (host_check, L, batch_load_host),
                                    (host_check, 1, batch_load_l1_host)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                lw = kg.load_layerwise(who, keys, cache, ids, layer_group=group)
                tiers = lw.finish()
                acc.append((time.perf_counter() - t0) / BATCH)
                assert all(t is not None for t in tiers), tiers
            delete(client, keys + single_keys)

        d2h_1 = pinned_copy_s(enc, 1, False)
        h2d_1 = pinned_copy_s(enc, 1, True)
        d2h_b = pinned_copy_s(enc, BATCH, False) / BATCH
        h2d_b = pinned_copy_s(enc, BATCH, True) / BATCH

        def entry(t, base):
            return {"s_per_chunk": t, "encoded_GBps": enc / t / 1e9,
                    "kv16_GBps": KV16_BYTES / t / 1e9, "pinned_memcpy_GBps": enc / base / 1e9,
                    "vs_pinned_memcpy": base / t}

        r = {"encoded_bytes_per_chunk": enc, "store_phases_ms": breakdown,
             "load_miss_ms": median(miss_s) * 1e3,
             "host_verify_GBps": enc / verify_s / 1e9,
             "store_single": entry(median(single_store), d2h_1),
             "store_single_engine_thread": entry(median(engine_thread), d2h_1),
             "store_batch": entry(median(batch_store), d2h_b),
             "store_batch_one_call": entry(median(one_call), d2h_b),
             "load_single": entry(median(single_load), h2d_1),
             "load_single_host_check": entry(median(single_load_host), h2d_1),
             "load_batch_layerwise_group32": entry(median(batch_load), h2d_b),
             "load_batch_layerwise_group1": entry(median(batch_load_l1), h2d_b),
             "load_batch_layerwise_group32_host_check": entry(median(batch_load_host), h2d_b),
             "load_batch_layerwise_group1_host_check": entry(median(batch_load_l1_host), h2d_b)}
        r["store_vs_pinned_memcpy"] = {"single": r["store_single"]["vs_pinned_memcpy"],
                                       "batch": r["store_batch"]["vs_pinned_memcpy"]}
        r["load_vs_pinned_memcpy"] = {"single": r["load_single"]["vs_pinned_memcpy"],
                                      "batch": r["load_batch_layerwise_group32"]["vs_pinned_memcpy"],
                                      "batch_group1": r["load_batch_layerwise_group1"]["vs_pinned_memcpy"]}
        results["codecs"][codec] = r
        print(f"{codec:7s} host verify (reader's check)     {r['host_verify_GBps']:6.1f} GB/s, "
              f"load of a missing key {r['load_miss_ms']:.3f} ms", flush=True)
        for name in ("store_single", "store_single_engine_thread", "store_batch",
                     "store_batch_one_call", "load_single", "load_single_host_check",
                     "load_batch_layerwise_group32",
                     "load_batch_layerwise_group1",
                     "load_batch_layerwise_group32_host_check",
                     "load_batch_layerwise_group1_host_check"):
            e = r[name]
            print(f"{codec:7s} {name:30s} {e['encoded_GBps']:6.1f} GB/s encoded "
                  f"{e['kv16_GBps']:6.1f} GB/s kv16  pinned {e['pinned_memcpy_GBps']:6.1f} GB/s "
                  f"ratio {e['vs_pinned_memcpy']:.2f}", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2)
    if len(sys.argv) > 3:
        trace_singles(client, cache, ids, sys.argv[3])
    host_check.close()
    client.close()


if __name__ == "__main__":
    main()

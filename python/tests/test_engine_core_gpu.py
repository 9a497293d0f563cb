"""kvtier.engine's mover on CUDA caches: the calls the vLLM connector makes
on a GPU worker (store through kvtier's GPU encode, layer-by-layer load with
per-layer waits), checked against the CPU codec path with the same data.
Skipped without a CUDA device or a libkvtier built with CUDA; needs no vLLM."""

import pytest
import torch

import kvtier
import kvtier.torch
from conftest import Daemon, corrupt_in_pool, cuda_skip_mark
from kvtier import engine

pytestmark = cuda_skip_mark()
DEV = torch.device("cuda", 0)

L, H, D, BS, CHUNK, NB = 4, 8, 128, 16, 64, 32


@pytest.fixture(scope="module")
def client(gpu_client):
    return gpu_client


def _layers(layout: str, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    if layout in ("nhd", "hnd"):
        shape = (NB, BS, H, D) if layout == "nhd" else (NB, H, BS, D)
        return [(torch.randn(shape, generator=g).to(torch.bfloat16).to(device),
                 torch.randn(shape, generator=g).to(torch.bfloat16).to(device)) for _ in range(L)]
    shape = {"flash_attn_nhd": (2, NB, BS, H, D), "flash_attn_hnd": (2, NB, H, BS, D),
             "flashinfer_nhd": (NB, 2, BS, H, D), "flashinfer_hnd": (NB, 2, H, BS, D)}[layout]
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(L)]


def _keys(ident, n, salt):
    return kvtier.chunk_keys(ident.fingerprint(), [salt] * (n * CHUNK), CHUNK)


LAYOUTS = ["flash_attn_nhd", "flash_attn_hnd", "flashinfer_nhd", "flashinfer_hnd", "nhd", "hnd"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", ["k16v16", "k16v8"])
def test_gpu_save_matches_cpu_and_layerwise_load_is_exact(client, layout, codec):
    ident = engine.engine_identity("tiny/gpu", torch.bfloat16, codec)
    src = engine.PagedKv(_layers(layout, 1, DEV), layout)
    cpu = engine.PagedKv(_layers(layout, 1, "cpu"), layout)
    gpu_mover = engine.KvMover(client, src, ident, CHUNK)
    cpu_mover = engine.KvMover(client, cpu, ident, CHUNK)
    assert gpu_mover.on_gpu and not cpu_mover.on_gpu
    # Distinct tokens per case: "nhd" and "hnd" layouts must not share keys
    # (a put of a stored key keeps the stored chunk).
    salt = 1 + 4 * LAYOUTS.index(layout) + 2 * (codec == "k16v8")
    keys, ref = _keys(ident, 2, salt), _keys(ident, 2, salt + 1)
    blocks = [[7, 2, 30, 11], [0, 1, 2, 3]]
    for key, rkey, ids in zip(keys, ref, blocks):
        gpu_mover.save(key, ids)
        cpu_mover.save(rkey, ids)
        assert client.get_bytes(key) == client.get_bytes(rkey)  # GPU encode == CPU reference
    dst = engine.PagedKv(_layers(layout, 2, DEV), layout)
    want = [t.clone() for t in dst.k]
    pending = engine.KvMover(client, dst, ident, CHUNK).load(keys, [[4, 5, 6, 7], [9, 8, 12, 13]],
                                                             layer_group=1)
    for layer in range(L):
        pending.wait_layer(layer)
    result = pending.finish()
    assert result.tiers == ["dram", "dram"] and result.failed == []
    torch.cuda.synchronize()
    back = engine.PagedKv(_layers(layout, 3, "cpu"), layout)
    engine.KvMover(client, back, ident, CHUNK).load(keys, [[4, 5, 6, 7], [9, 8, 12, 13]]).finish()
    for layer in range(L):
        for dst_ids in ([4, 5, 6, 7], [9, 8, 12, 13]):
            assert torch.equal(dst.k[layer][dst_ids].cpu(), back.k[layer][dst_ids])
            assert torch.equal(dst.v[layer][dst_ids].cpu(), back.v[layer][dst_ids])
        assert torch.equal(dst.k[layer][20], want[layer][20])
        if codec == "k16v16":
            assert torch.equal(dst.k[layer][[4, 5, 6, 7]], src.k[layer][[7, 2, 30, 11]])
            assert torch.equal(dst.v[layer][[9, 8, 12, 13]], src.v[layer][[0, 1, 2, 3]])
        assert not torch.isnan(dst.v[layer]).any()


def test_gpu_layerwise_load_reports_corrupt_and_missing_chunks(client):
    ident = engine.engine_identity("tiny/gpu", torch.bfloat16, "k16v16")
    src = engine.PagedKv(_layers("flash_attn_nhd", 4, DEV))
    mover = engine.KvMover(client, src, ident, CHUNK)
    keys = _keys(ident, 3, 99)
    mover.save(keys[0], [0, 1, 2, 3])
    mover.save(keys[1], [4, 5, 6, 7])
    corrupt_in_pool(client, keys[1])
    dst = engine.PagedKv(_layers("flash_attn_nhd", 5, DEV))
    result = engine.KvMover(client, dst, ident, CHUNK).load(
        keys, [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]).finish()
    assert result.tiers[0] == "dram" and result.failed == [1, 2]
    for layer in range(L):
        assert torch.equal(dst.k[layer][[8, 9, 10, 11]], src.k[layer][[0, 1, 2, 3]])


def test_one_group_load_and_a_wait_for_its_last_layer_cover_every_layer(client):
    """The vLLM connector without layerwise_load: one decode group of every
    layer, and the compute stream waits for the load's last event before the
    forward. Kernels queued on that stream after the wait (before finish())
    read every layer's loaded KV."""
    layout = "flash_attn_nhd"
    ident = engine.engine_identity("tiny/gpu-one-group", torch.bfloat16, "k16v16")
    src = engine.PagedKv(_layers(layout, 4, DEV), layout)
    keys = _keys(ident, 2, 101)
    mover = engine.KvMover(client, src, ident, CHUNK)
    src_ids, dst_ids = [[7, 2, 30, 11], [0, 1, 2, 3]], [[4, 5, 6, 7], [9, 8, 12, 13]]
    for key, ids in zip(keys, src_ids, strict=True):
        mover.save(key, ids)
    dst = engine.PagedKv(_layers(layout, 5, DEV), layout)
    compute = torch.cuda.Stream(DEV)
    with torch.cuda.stream(compute):
        pending = engine.KvMover(client, dst, ident, CHUNK).load(keys, dst_ids, layer_group=L)
        pending.wait_layer(L - 1)
        got = [(dst.k[layer][dst_ids[0] + dst_ids[1]].clone(),
                dst.v[layer][dst_ids[0] + dst_ids[1]].clone()) for layer in range(L)]
    result = pending.finish()
    compute.synchronize()
    assert result.tiers == ["dram", "dram"] and result.failed == []
    for layer, (k, v) in enumerate(got):
        assert torch.equal(k, src.k[layer][src_ids[0] + src_ids[1]]), layer
        assert torch.equal(v, src.v[layer][src_ids[0] + src_ids[1]]), layer


def test_a_gpu_mover_registers_the_pool_with_cuda_when_it_is_made(client, tmp_path):
    """The pool's CUDA registration holds up the process's CUDA calls for
    seconds: a mover pays it when the engine makes it, not at the first store
    between requests (vllm serve showed 2 s TTFTs there)."""
    from kvtier.torch import _gpu
    ident = engine.engine_identity("tiny/gpu", torch.bfloat16, "k16v8")
    d = Daemon(tmp_path, dram_gib="1").start()
    try:
        with kvtier.Client(socket=d.socket) as fresh:
            assert fresh not in _gpu._gpus_by_client
            kv = engine.PagedKv(_layers("flash_attn_nhd", 3, DEV), "flash_attn_nhd")
            engine.KvMover(fresh, kv, ident, CHUNK)
            assert list(_gpu._gpus_by_client[fresh]) == [DEV.index]
            assert kvtier.torch.open_gpu(fresh, DEV) < 0.5  # open already: nothing to do
    finally:
        d.stop()
    with pytest.raises(ValueError, match="CUDA device"):
        kvtier.torch.open_gpu(client, "cpu")

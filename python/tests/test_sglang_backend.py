"""kvtier.sglang.KvtierHiCacheStorage through SGLang's own storage factory,
base class and MHA host pool (on the CPU), against a real kvtierd.

Runs in the engines venv where SGLang is installed (scripts/python-venv with
requirements-sglang.txt)."""
from __future__ import annotations

import time

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

import kvtier
from conftest import Daemon, corrupt_in_pool, eventually
from kvtier import engine
from kvtier.sglang import KvtierHiCacheStorage

LAYERS, HEADS, DIM, PAGE = 2, 2, 16, 16


@pytest.fixture
def kvtierd(tmp_path):
    d = Daemon(tmp_path).start()
    yield d
    d.kill()


def host_pool(layout: str, seed: int = 0, page: int = PAGE, layers: int = LAYERS,
              heads: int = HEADS, dim: int = DIM) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool on the CPU (8 device pages, twice that on the host),
    filled with integer-valued random KV. SGLang 0.5.23 describes the device
    pool by its buffers; 0.5.17 (the GPU machine's) hands over the pool itself."""
    try:
        from sglang.srt.mem_cache.device_pool_info import (
            KVBufferLayout,
            KVBuffers,
            MHABufferInfo,
        )
    except ImportError:  # SGLang before the device pool descriptions (0.5.17)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        device = MHATokenToKVPool(size=8 * page, page_size=page, dtype=torch.bfloat16,
                                  head_num=heads, head_dim=dim, layer_num=layers, device="cpu",
                                  enable_memory_saver=False, enable_alt_stream=False)
        pool = MHATokenToKVPoolHost(device, host_to_device_ratio=2.0, host_size=0,
                                    page_size=page, layout=layout, pin_memory=False,
                                    device="cpu")
    else:
        k = tuple(torch.zeros(9 * page, heads, dim, dtype=torch.bfloat16)
                  for _ in range(layers))
        v = tuple(torch.zeros_like(t) for t in k)
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
        info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k),
                                               v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
                             page_size=page, head_num=heads, head_dim=dim, v_head_dim=dim,
                             dtype=torch.bfloat16, device=torch.device("cpu"))
        pool = MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=page,
                                    layout=layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=8 * page, start_layer=0,
                                    end_layer=layers)
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randint(-100, 100, pool.kv_buffer.shape, generator=g))
    return pool


def storage_config(d, model_name: str = "tiny/model", tp: tuple = (0, 1),
                   **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
        model_name=model_name,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.sglang",
                      "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
                      "socket": d.socket, "codec": "k16v16",
                      "lookup_timeout_ms": 10000, **extra})


def backend(d, pool, model_name: str = "tiny/model", tp: tuple = (0, 1),
            **extra) -> KvtierHiCacheStorage:
    """The backend as SGLang makes it: the "dynamic" factory path, then the host
    pool; ``tp`` = (rank, size) of the tensor-parallel worker it serves."""
    b = StorageBackendFactory.create_backend("dynamic",
                                             storage_config(d, model_name, tp, **extra), pool)
    b.register_mem_pool_host(pool)
    return b


def page_kv(pool, index: int):
    """K and V [layers, page, heads, dim] of the host page at token ``index`` (copies)."""
    buf, ps = pool.kv_buffer, pool.page_size
    if pool.layout == "layer_first":
        return buf[0, :, index:index + ps].clone(), buf[1, :, index:index + ps].clone()
    if pool.layout == "page_first":
        return (buf[0, index:index + ps].transpose(0, 1).clone(),
                buf[1, index:index + ps].transpose(0, 1).clone())
    return buf[0, index // ps].clone(), buf[1, index // ps].clone()


def indices(pages, page: int = PAGE) -> torch.Tensor:
    """SGLang's host indices of whole pages: every token slot of each page."""
    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_batch_set_then_get_round_trips_through_the_host_pool(kvtierd, layout):
    src, dst = host_pool(layout, 1), host_pool(layout, 2)
    b = backend(kvtierd, src)
    assert isinstance(b, HiCacheStorage)
    keys = [f"{i:064x}" for i in range(1, 4)]  # SGLang's page hashes
    assert b.batch_set_v1(keys, indices([3, 0, 5])) == [True] * 3
    assert b.batch_exists(keys) == 3 and b.exists(keys[1])
    assert b.batch_exists(keys[:1] + ["f" * 64]) == 1
    r = backend(kvtierd, dst, page_threads=1)  # the caller's thread alone
    untouched = page_kv(dst, 4 * PAGE)
    assert r.batch_get_v1(keys, indices([1, 2, 7])) == [True] * 3
    for s, t in ((3, 1), (0, 2), (5, 7)):
        for a, c in zip(page_kv(src, s * PAGE), page_kv(dst, t * PAGE)):
            assert torch.equal(a, c)
    assert all(torch.equal(a, c) for a, c in zip(untouched, page_kv(dst, 4 * PAGE)))
    stats = r.get_stats()
    assert stats.prefetch_pgs == [3] and stats.prefetch_bandwidth[0] > 0
    assert r.get_stats().prefetch_pgs == []
    b.clear()
    assert b.batch_exists(keys) == 0


def test_tensor_parallel_ranks_keep_their_own_shards_of_a_page(kvtierd):
    # Every rank of a TP-2 SGLang hands its backend the same page hashes; each
    # stores and reads back its own shard, and a TP-1 engine finds neither.
    keys = [f"{i:064x}" for i in range(40, 42)]
    src = [host_pool("page_first", 20 + r) for r in range(2)]
    for r in range(2):
        assert backend(kvtierd, src[r], tp=(r, 2)).batch_set_v1(keys, indices([1, 2])) == [True] * 2
    for r in range(2):
        dst = host_pool("page_first", 30 + r)
        assert backend(kvtierd, dst, tp=(r, 2)).batch_get_v1(keys, indices([5, 6])) == [True] * 2
        for s, t in ((1, 5), (2, 6)):
            for a, c in zip(page_kv(src[r], s * PAGE), page_kv(dst, t * PAGE)):
                assert torch.equal(a, c), r
    assert backend(kvtierd, host_pool("page_first", 40)).batch_exists(keys) == 0


@pytest.mark.parametrize("field", ["pp_size", "attn_cp_size"])
def test_pipeline_and_context_parallel_ranks_are_refused(kvtierd, field):
    config = storage_config(kvtierd)
    setattr(config, field, 2)
    with pytest.raises(ValueError, match=f"{field} 2"):
        KvtierHiCacheStorage(config)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_generic_get_and_set_use_flat_pages(kvtierd, layout):
    src, dst = host_pool(layout, 3), host_pool(layout, 4)
    b = backend(kvtierd, src)
    assert b.set("a" * 64, src.get_data_page(2 * PAGE))
    assert b.batch_set(["c" * 64, "e" * 64], [src.get_data_page(p * PAGE) for p in (4, 5)])
    got = b.batch_get(["a" * 64, "b" * 64, "e" * 64],
                      [dst.get_dummy_flat_data_page() for _ in range(3)])
    assert got[1] is None  # a miss
    for page, flat in ((2, got[0]), (5, got[2])):
        dst.set_from_flat_data_page(6 * PAGE, flat)
        assert torch.equal(dst.get_data_page(6 * PAGE), src.get_data_page(page * PAGE))
    # Without targets the backend makes the flat pages.
    assert torch.equal(b.get("c" * 64), src.get_data_page(4 * PAGE).flatten())
    assert b.get("b" * 64) is None
    # A target of another dtype is refused before anything is read into it.
    wrong = torch.zeros(dst.get_dummy_flat_data_page().numel(), dtype=torch.float32)
    with pytest.raises(ValueError, match="CPU tensor of"):
        b.batch_get(["a" * 64], [wrong])
    assert not wrong.any()


def test_missing_corrupt_and_foreign_pages_are_false(kvtierd):
    src = host_pool("page_first", 5)
    b = backend(kvtierd, src)
    keys = [f"{i:064x}" for i in range(10, 13)]
    assert b.batch_set_v1(keys[:2], indices([0, 1])) == [True, True]
    with kvtier.Client(socket=kvtierd.socket) as c:
        corrupt_in_pool(c, b.kvtier_key(keys[1]))
    other = backend(kvtierd, host_pool("page_first", 7), model_id="other/model")
    other.batch_set_v1(["e" * 64], indices([0]))
    # Another model's chunk under this backend's key: refused, not decoded.
    with kvtier.Client(socket=kvtierd.socket) as c:
        c.put(b.kvtier_key("d" * 64), c.get_bytes(other.kvtier_key("e" * 64)))
    # The backend reads into its own pool (src): a missing page and a foreign
    # chunk leave theirs untouched (a corrupt one may be partly decoded: its
    # page is False, and SGLang frees it).
    before = [page_kv(src, p * PAGE) for p in (4, 5)]
    assert b.batch_get_v1(keys + ["d" * 64], indices([2, 3, 4, 5])) == [True, False, False, False]
    after = [page_kv(src, p * PAGE) for p in (4, 5)]
    assert all(torch.equal(x, y) for a, c in zip(before, after) for x, y in zip(a, c))
    # The good page is page 0's KV (k16v16: exact).
    assert all(torch.equal(x, y) for x, y in zip(page_kv(src, 2 * PAGE), page_kv(src, 0)))


def test_a_stopped_daemon_is_a_bounded_miss(kvtierd):
    b = backend(kvtierd, host_pool("page_first"), lookup_timeout_ms=300, retry_after_ms=0)
    keys = [f"{i:064x}" for i in range(20, 22)]
    b.batch_set_v1(keys, indices([0, 1]))
    eventually(lambda: b.batch_exists(keys) == 2)  # connected
    kvtierd.pause()
    try:
        t0 = time.monotonic()
        assert b.batch_exists(keys) == 0
        assert time.monotonic() - t0 < 1.5
    finally:
        kvtierd.resume()


def test_bad_config_and_pools_are_clear_errors(kvtierd):
    with pytest.raises(ValueError, match="unknown setting 'sokcet'"):
        backend(kvtierd, host_pool("page_first"), sokcet="/x")
    cfg = storage_config(kvtierd)
    cfg.is_mla_model = True
    with pytest.raises(ValueError, match="MLA"):
        KvtierHiCacheStorage(cfg)
    b = KvtierHiCacheStorage(storage_config(kvtierd))
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        b.batch_get_v1(["a" * 64], indices([0]))
    with pytest.raises(ValueError, match="page_head"):
        b.register_mem_pool_host(host_pool("page_head"))


def test_kvtier_keys_reach_chunks_other_engines_stored(kvtierd):
    """A chunk stored through kvtier.engine (the vLLM connector's mover) under
    kvtier's token-chain key is found and loaded by the SGLang backend with the
    same key."""
    tokens = list(range(500, 500 + 2 * PAGE + 3))
    ident = engine.engine_identity("tiny/model", torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens, PAGE)
    src = engine.PagedKv([torch.randint(-9, 9, (2, 4, PAGE, HEADS, DIM)).to(torch.bfloat16)
                          for _ in range(LAYERS)], "flash_attn_nhd")
    with kvtier.Client(socket=kvtierd.socket) as c:
        mover = engine.KvMover(c, src, ident, PAGE)
        mover.save(keys[0], [2])
        mover.save(keys[1], [0])
    dst = host_pool("page_first_direct", 8)
    b = backend(kvtierd, dst)
    hex_keys = [kvtier.key_hex(k) for k in keys]
    assert b.batch_exists(hex_keys) == 2
    assert b.batch_get_v1(hex_keys, indices([4, 6])) == [True, True]
    k, v = page_kv(dst, 4 * PAGE)
    assert torch.equal(k, torch.stack([src.k[layer][2] for layer in range(LAYERS)]))
    k, v = page_kv(dst, 6 * PAGE)
    assert torch.equal(v, torch.stack([src.v[layer][0] for layer in range(LAYERS)]))


def test_keys_of_any_string_are_stable_and_distinct(kvtierd):
    b = backend(kvtierd, host_pool("page_first"))
    assert b.kvtier_key("ab" * 16) == bytes.fromhex("ab" * 16)  # a kvtier key as it is
    odd = ["zz" * 16, "", "x" * 100000, "\u00e9\u0000", "0" * 64]
    keys = [b.kvtier_key(k) for k in odd]
    assert len(set(keys)) == len(odd) and all(len(k) == 16 for k in keys)
    assert keys == [b.kvtier_key(k) for k in odd]
    other = backend(kvtierd, host_pool("page_first"), model_name="other/model")
    assert other.kvtier_key("zz" * 16) != keys[0]  # a model's keys are its own
    assert b.batch_get_v1(["x" * 100000], indices([0])) == [False]

"""kvtier's GPU path for PyTorch (kvtier/torch/_gpu.py, re-exported by
kvtier.torch) against a real kvtierd (conftest.Daemon). Skipped without torch,
a CUDA device or a libkvtier built with CUDA."""

import time

import pytest

try:
    import torch
except ImportError:
    torch = None

import kvtier  # noqa: E402
from conftest import cuda_skip_mark, have_cuda  # noqa: E402

HAVE_CUDA = have_cuda()
pytestmark = cuda_skip_mark()

if HAVE_CUDA:
    from kvtier.torch import _gpu as kg
    from kvtier import torch as kt

    DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def client(gpu_client):
    return gpu_client


def _decode_cpu(chunk: bytes):
    """The CPU codec's values of a chunk, [layers, tokens, heads, dim] as int16 bits."""
    k, v = kt.decode_chunk(chunk)
    return k.view(torch.int16), v.view(torch.int16)


L, H, D, BS, T = 4, 8, 128, 16, 256
NB = 64


def _key(i: int) -> bytes:
    return bytes([0xC0, 0xDE]) + i.to_bytes(14, "big")


def _vllm_cache(seed, dtype=torch.bfloat16, layout="flash_attn_nhd"):
    g = torch.Generator(device=DEV).manual_seed(seed)
    shape = {"flash_attn_nhd": (2, NB, BS, H, D), "flash_attn_hnd": (2, NB, H, BS, D),
             "flashinfer_nhd": (NB, 2, BS, H, D), "flashinfer_hnd": (NB, 2, H, BS, D)}[layout]
    layers = [torch.randn(shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)
              for _ in range(L)]
    return layers, kg.PagedCache.from_vllm(layers, layout=layout)


def _gather(layers, ids, layout="flash_attn_nhd"):
    """[layers, tokens, heads, dim] K and V of the tokens at ids (whole blocks)."""
    ks, vs = [], []
    idx = torch.tensor(ids, device=DEV)
    for t in layers:
        if layout == "flash_attn_nhd":
            k, v = t[0][idx], t[1][idx]  # [n, BS, H, D]
        elif layout == "flash_attn_hnd":
            k, v = t[0][idx].transpose(1, 2), t[1][idx].transpose(1, 2)
        elif layout == "flashinfer_nhd":
            k, v = t[idx, 0], t[idx, 1]
        else:
            k, v = t[idx, 0].transpose(1, 2), t[idx, 1].transpose(1, 2)
        ks.append(k.reshape(-1, H, D))
        vs.append(v.reshape(-1, H, D))
    return torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("layout", ["flash_attn_nhd", "flash_attn_hnd", "flashinfer_nhd",
                                    "flashinfer_hnd"])
def test_k16v16_round_trip_is_bit_exact(client, layout):
    src_layers, src = _vllm_cache(1, layout=layout)
    ids = list(range(3, 3 + T // BS))
    key = _key(10 + ["flash_attn_nhd", "flash_attn_hnd", "flashinfer_nhd", "flashinfer_hnd"].index(layout))
    kt.store(client, key, src, ids, codec="k16v16")
    dst_layers, dst = _vllm_cache(2, layout=layout)
    for t in dst_layers:
        t.zero_()
    out_ids = list(range(40, 40 + T // BS))[::-1]
    tier = kg.load(client, key, dst, out_ids)
    assert tier == "dram"
    assert client.load(key, dst, out_ids) == "dram"  # Client.load delegates here
    k0, v0 = _gather(src_layers, ids, layout)
    k1, v1 = _gather(dst_layers, out_ids, layout)
    assert torch.equal(k0.view(torch.int16), k1.view(torch.int16))
    assert torch.equal(v0.view(torch.int16), v1.view(torch.int16))


def test_k16v8_load_matches_the_cpu_codec(client):
    src_layers, src = _vllm_cache(3)
    ids = list(range(0, 2 * (T // BS), 2))
    key = _key(100)
    kg.store(client, key, src, ids, codec="k16v8", fingerprint=b"\x07" * 16)
    chunk = client.get_bytes(key)
    kc, vc = _decode_cpu(chunk)
    dst_layers, dst = _vllm_cache(4)
    out_ids = list(range(NB - T // BS, NB))
    assert kg.load(client, key, dst, out_ids) == "dram"
    k1, v1 = _gather(dst_layers, out_ids)
    assert torch.equal(k1.view(torch.int16).cpu(), kc)
    assert torch.equal(v1.view(torch.int16).cpu(), vc)
    k0, _ = _gather(src_layers, ids)
    assert torch.equal(k0.view(torch.int16), k1.view(torch.int16)), "K stays 16-bit"


def test_store_by_layer_ranges_gives_the_same_chunk(client):
    _, src = _vllm_cache(5)
    ids = list(range(T // BS))
    kg.store(client, _key(200), src, ids, codec="k16v8")
    side = torch.cuda.Stream(DEV)
    with kg.begin_store(client, src, T, codec="k16v8") as op:
        op.encode_layers(ids, range(0, 1))
        op.encode_layers(ids, (1, 3), stream=side)
        op.encode_layers(ids, 3, stream=side)
        op.commit(_key(201))
    assert client.get_bytes(_key(200)) == client.get_bytes(_key(201))
    op = kg.begin_store(client, src, T)
    with pytest.raises(ValueError):
        op.encode_layers(ids, (1, 2))  # must start at layer 0
    op.close()


def test_store_batch_gives_each_chunk_of_a_store(client):
    _, src = _vllm_cache(6)
    per = [list(range(c * (T // BS), (c + 1) * (T // BS))) for c in range(4)]
    for c, ids in enumerate(per):
        kg.store(client, _key(210 + c), src, ids, codec="k16v8")
    keys = [_key(220 + c) for c in range(4)]
    assert kg.store_batch(client, keys, src, per, codec="k16v8") == [None] * 4
    for c in range(4):
        assert client.get_bytes(keys[c]) == client.get_bytes(_key(210 + c))
    assert kg.store_batch(client, [], src, []) == []
    with pytest.raises(ValueError):
        kg.store_batch(client, keys[:2], src, [per[0], per[1][:-1]])  # unequal block counts
    with pytest.raises(ValueError):
        kg.store_batch(client, keys[:2], src, per[:1])


def test_store_without_waiting_stores_the_same_chunk_and_reports_through_its_handle(client):
    # wait=False returns once the encode and copy are queued; a libkvtier
    # thread commits. The chunk is the one a waiting store makes.
    _, src = _vllm_cache(14)
    ids = list(range(T // BS))
    kg.store(client, _key(700), src, ids, codec="k16v8")
    op = kg.store(client, _key(701), src, ids, codec="k16v8", wait=False)
    try:
        op.wait(timeout=30)
        assert op.done()
        op.wait()  # the same answer again
        with pytest.raises(ValueError):
            op.commit(_key(702))  # committed already
        with pytest.raises(ValueError):
            op.encode_layers(ids, None)
    finally:
        op.close()
    assert client.get_bytes(_key(701)) == client.get_bytes(_key(700))
    # Closed before its commit ended: the commit goes on and the chunk is stored.
    op = kg.store(client, _key(703), src, ids, codec="k16v8", wait=False)
    op.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            assert client.get_bytes(_key(703)) == client.get_bytes(_key(700))
            break
        except kvtier.NotFound:
            assert time.monotonic() < deadline, "the detached commit never stored the chunk"
            time.sleep(0.01)
    # By layer ranges, then a commit that does not wait.
    op = kg.begin_store(client, src, T, codec="k16v8")
    with pytest.raises(ValueError):
        op.wait()  # nothing to wait for yet
    op.encode_layers(ids, range(0, 2))
    op.encode_layers(ids, range(2, L))
    op.commit(_key(704), wait=False)
    op.wait()
    op.close()
    assert client.get_bytes(_key(704)) == client.get_bytes(_key(700))


def test_a_failed_commit_without_waiting_is_reported_by_wait(tmp_path):
    # The daemon goes away between the encode and the commit: the commit
    # thread's error comes back through wait(), and again at every call.
    from conftest import Daemon
    d = Daemon(tmp_path, dram_gib="0.25", nvme_gib="0").start()
    c = kvtier.Client(socket=d.socket)
    try:
        _, src = _vllm_cache(15)
        op = kg.begin_store(c, src, T, codec="k16v8")
        op.encode_layers(list(range(T // BS)), None)
        d.stop()
        op.commit(_key(710), wait=False)
        with pytest.raises(kvtier.KvtierError) as first:
            op.wait(timeout=60)
        assert not isinstance(first.value, kvtier.DeadlineExceeded)
        assert op.done()
        with pytest.raises(type(first.value)):
            op.wait(0)
        op.close()
    finally:
        c.close()
        d.stop()


def test_every_entry_refuses_a_block_id_outside_the_cache(client):
    # Each entry checks the block list once; a bad id is InvalidArgument
    # before any kernel runs: nothing is stored, no destination block written.
    _, src = _vllm_cache(12)
    ids = list(range(T // BS))
    bad = ids[:-1] + [NB]
    neg = [-1] + ids[1:]
    for b in (bad, neg):
        with pytest.raises(kvtier.InvalidArgument):
            kg.store(client, _key(650), src, b, codec="k16v8")
        assert kg.store_batch(client, [_key(651), _key(652)], src, [ids, b])[1] is not None
        op = kg.begin_store(client, src, T)
        with pytest.raises(kvtier.InvalidArgument):
            op.encode_layers(b, range(0, L))
        op.close()
    with pytest.raises(kvtier.NotFound):
        client.get_bytes(_key(650))
    with pytest.raises(kvtier.NotFound):
        client.get_bytes(_key(652))
    assert client.get_bytes(_key(651))  # the good chunk of the batch is stored
    dst_layers, dst = _vllm_cache(13)
    before = [t.clone() for t in dst_layers]
    for b in (bad, neg):
        with pytest.raises(kvtier.InvalidArgument):
            kg.load(client, _key(651), dst, b)
        lw = kg.load_layerwise(client, [_key(651)], dst, [b])
        assert lw.finish() == [None]
        assert lw.statuses == [3]  # INVALID_ARGUMENT
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst_layers[l].view(torch.int16), before[l].view(torch.int16))


def test_load_of_a_layer_range_writes_only_those_layers(client):
    src_layers, src = _vllm_cache(6)
    ids = list(range(T // BS))
    kg.store(client, _key(300), src, ids, codec="k16v16")
    dst_layers, dst = _vllm_cache(7)
    before = [t.clone() for t in dst_layers]
    kg.load(client, _key(300), dst, ids, layers=range(1, 3))
    for l in range(L):
        if l in (1, 2):
            assert torch.equal(dst_layers[l][:, :T // BS].view(torch.int16),
                               src_layers[l][:, :T // BS].view(torch.int16))
        else:
            assert torch.equal(dst_layers[l].view(torch.int16), before[l].view(torch.int16))


def test_layerwise_load_of_a_batch(client):
    src_layers, src = _vllm_cache(8)
    n = 3
    keys = [_key(400 + i) for i in range(n)]
    src_ids = [list(range(i * (T // BS), (i + 1) * (T // BS))) for i in range(n)]
    for k, ids in zip(keys, src_ids):
        kg.store(client, k, src, ids, codec="k16v16")
    dst_layers, dst = _vllm_cache(9)
    for t in dst_layers:
        t.zero_()
    missing = _key(499)
    compute = torch.cuda.Stream(DEV)
    lw = kg.load_layerwise(client, keys + [missing], dst, src_ids + [[60]], layer_group=2)
    sums = []
    with torch.cuda.stream(compute):
        for l in range(L):
            lw.wait_layer(l)
            sums.append(dst_layers[l].float().abs().sum())
    tiers = lw.finish()
    assert tiers == ["dram"] * n + [None]
    assert lw.statuses[-1] == 5  # NOT_FOUND
    with pytest.raises(kvtier.NotFound):
        kg.load(client, missing, dst, [60])
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst_layers[l][:, : n * T // BS].view(torch.int16),
                           src_layers[l][:, : n * T // BS].view(torch.int16))
        assert sums[l].item() > 0


def test_contiguous_hf_cache_round_trip(client):
    seq = 300
    g = torch.Generator(device=DEV).manual_seed(11)
    ks = [torch.randn(2, H, seq, D, generator=g, device=DEV).to(torch.bfloat16) for _ in range(L)]
    vs = [torch.randn(2, H, seq, D, generator=g, device=DEV).to(torch.bfloat16) for _ in range(L)]
    src = kg.PagedCache.from_contiguous(ks, vs, block_size=64, batch_index=1)
    assert src.num_blocks == 5
    kg.store(client, _key(500), src, [0, 1, 2, 3], codec="k16v16", num_tokens=256)
    kd = [torch.zeros_like(x) for x in ks]
    vd = [torch.zeros_like(x) for x in vs]
    dst = kg.PagedCache.from_contiguous(kd, vd, block_size=64, batch_index=1)
    kg.load(client, _key(500), dst, [0, 1, 2, 3])
    for l in range(L):
        assert torch.equal(kd[l][1, :, :256], ks[l][1, :, :256])
        assert torch.equal(vd[l][1, :, :256], vs[l][1, :, :256])
        assert kd[l][0].abs().sum().item() == 0 and kd[l][1, :, 256:].abs().sum().item() == 0
    with pytest.raises(ValueError):
        kg.store(client, _key(501), src, [4], num_tokens=64)  # past the sequence


def test_separate_hnd_with_fp8_v(client):
    g = torch.Generator(device=DEV).manual_seed(12)
    ks = [torch.randn(NB, H, BS, D, generator=g, device=DEV).to(torch.bfloat16) for _ in range(L)]
    vs = [(torch.randn(NB, H, BS, D, generator=g, device=DEV) * 50).to(torch.float8_e4m3fn)
          for _ in range(L)]
    sc = [torch.rand(NB, H, generator=g, device=DEV) + 0.5 for _ in range(L)]
    src = kg.PagedCache.from_separate(ks, vs, layout="hnd", v_scales=sc)
    ids = list(range(T // BS))
    kg.store(client, _key(600), src, ids, codec="k16v8")
    kd = [torch.zeros_like(x) for x in ks]
    vd = [torch.zeros_like(x) for x in vs]
    sd = [torch.zeros_like(x) for x in sc]
    dst = kg.PagedCache.from_separate(kd, vd, layout="hnd", v_scales=sd)
    kg.load(client, _key(600), dst, ids)
    n = T // BS
    for l in range(L):
        assert torch.equal(kd[l][:n], ks[l][:n])
        assert torch.equal(vd[l][:n].view(torch.uint8), vs[l][:n].view(torch.uint8))
        assert torch.equal(sd[l][:n], sc[l][:n])


def test_decode_attention_matches_a_torch_reference():
    layers, cache = _vllm_cache(13)
    batch, hq = 5, 32
    g = torch.Generator(device=DEV).manual_seed(14)
    q = torch.randn(batch, hq, D, generator=g, device=DEV).to(torch.bfloat16)
    max_blocks = 8
    table = torch.randint(0, NB, (batch, max_blocks), generator=g, device=DEV, dtype=torch.int32)
    lens = torch.tensor([1, 17, 64, 100, 128], device=DEV, dtype=torch.int32)
    layer = 2
    out = kg.decode_attention(q, cache, table, lens, layer, check=True)
    torch.cuda.synchronize()
    scale = 1.0 / D ** 0.5
    t = layers[layer].double()
    ref = torch.empty(batch, hq, D, dtype=torch.float64, device=DEV)
    for b in range(batch):
        n = int(lens[b])
        blocks = table[b].long()
        k = t[0][blocks].reshape(-1, H, D)[:n]  # [n, H, D]
        v = t[1][blocks].reshape(-1, H, D)[:n]
        qb = q[b].double().view(H, hq // H, D)
        s = torch.einsum("hgd,nhd->hgn", qb, k) * scale
        p = torch.softmax(s, dim=-1)
        ref[b] = torch.einsum("hgn,nhd->hgd", p, v).reshape(hq, D)
    o = out.double()
    assert not torch.isnan(o).any() and o.abs().sum() > 0
    rel = (o - ref).norm() / ref.norm()
    assert rel < 1e-2, rel
    assert ((o - ref).abs() <= 3e-2 * ref.abs().max()).all()


def test_wrong_inputs_raise_before_launch(client):
    layers, cache = _vllm_cache(15)
    with pytest.raises(TypeError):
        kg.PagedCache.from_vllm([x.float() for x in layers])
    with pytest.raises(ValueError):
        kg.PagedCache.from_vllm([x.cpu() for x in layers])
    with pytest.raises(ValueError):
        kg.PagedCache.from_vllm(layers, layout="nope")
    with pytest.raises(ValueError):
        kg.store(client, _key(700), cache, [NB])  # block id out of range
    with pytest.raises(ValueError):
        kg.load(client, _key(700), cache, [0], layers=(2, 9))
    q = torch.zeros(2, 32, D, device=DEV, dtype=torch.float16)
    table = torch.zeros(2, 4, device=DEV, dtype=torch.int32)
    lens = torch.ones(2, device=DEV, dtype=torch.int32)
    with pytest.raises(TypeError):
        kg.decode_attention(q, cache, table, lens, 0)  # fp16 q, bf16 cache
    with pytest.raises(TypeError):
        kg.decode_attention(q.bfloat16(), cache, table.long(), lens, 0)

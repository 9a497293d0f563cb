"""kvtier.torch's CPU codec over tensors: round trips, layer ranges, clear
errors before anything runs, and a store/load of tensors through a real
kvtierd."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
import kvtier.torch as kt  # noqa: E402

FP = kvtier.ModelIdentity("test/torch", codec="k16v8").fingerprint()


def kv(layers=3, tokens=32, heads=2, dim=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, tokens, heads, dim, generator=g).to(dtype)
    v = torch.randn(layers, tokens, heads, dim, generator=g).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_k16v16_round_trip_is_exact(dtype):
    k, v = kv(dtype=dtype)
    chunk = kt.encode_chunk(FP, k, v, codec="k16v16")
    k2, v2 = kt.decode_chunk(chunk)
    assert k2.dtype == dtype
    assert torch.equal(k2, k) and torch.equal(v2, v)
    k1, v1 = kt.decode_chunk(chunk, layers=(1, 3))
    assert torch.equal(k1, k[1:3]) and torch.equal(v1, v[1:3])


def test_k16v8_keys_exact_values_close():
    k, v = kv()
    chunk = kt.encode_chunk(FP, k, v, codec="k16v8", block_size=16)
    info = kt.inspect_chunk(chunk)
    assert (info.codec, info.block_size, info.num_tokens) == ("k16v8", 16, 32)
    k2, v2 = kt.decode_chunk(chunk)
    assert torch.equal(k2, k)
    rel = (v2.float() - v.float()).norm() / v.float().norm()
    assert 0 < rel < 0.05  # FP8 e4m3 with per-(block, head) scales


def test_non_contiguous_input_is_encoded_as_its_values():
    k, v = kv(layers=2)
    kt_ = k.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not kt_.is_contiguous()
    assert bytes(kt.encode_chunk(FP, kt_, v, codec="k16v16")) == \
        bytes(kt.encode_chunk(FP, k, v, codec="k16v16"))


def test_wrong_inputs_are_clear_errors():
    k, v = kv()
    with pytest.raises(TypeError):
        kt.encode_chunk(FP, k.float(), v.float())
    with pytest.raises(ValueError):
        kt.encode_chunk(FP, k[0], v[0])  # 3-d
    with pytest.raises(ValueError):
        kt.encode_chunk(FP, k, v[:, :16])
    with pytest.raises(TypeError):
        kt.encode_chunk(FP, [1, 2], v)
    spec = kt.spec_for(FP, k, codec="k16v16")
    with pytest.raises(ValueError):
        kt.encode_chunk(spec, k[:, :16], v[:, :16])
    with pytest.raises(kvtier.InvalidArgument):
        kt.encode_chunk(FP, k, v, codec="nonsense")
    chunk = kt.encode_chunk(FP, k, v)
    with pytest.raises(ValueError):
        kt.decode_chunk(chunk, layers=(2, 2))
    with pytest.raises(kvtier.KvtierError):
        kt.decode_chunk(bytes(chunk)[:-3])


def test_tensors_through_the_daemon(daemon):
    k, v = kv(layers=4, tokens=64)
    keys = kvtier.prefix_keys("test/torch", list(range(128)), chunk_tokens=64, codec="k16v8")
    with kvtier.Client(socket=daemon.socket) as c:
        for i, key in enumerate(keys):
            c.put(key, kt.encode_chunk(FP, k + i, v - i, codec="k16v8"))
        assert c.lookup(keys) == ["dram", "dram"]
        with c.get(keys[1]) as chunk:
            k2, v2 = kt.decode_chunk(chunk.data)
        assert torch.equal(k2, k + 1)


def test_host_page_of_tensors_checks_its_views():
    # SGLang's page_first host pool: [2, tokens, layers, heads, dim].
    buf = torch.zeros((2, 64, 4, 2, 8), dtype=torch.bfloat16)
    k, v = buf[0].transpose(0, 1), buf[1].transpose(0, 1)
    page = kvtier.HostPage.of(k, v)
    assert (page.layer_stride, page.token_stride) == (16, 64)
    assert page.k == k.data_ptr() and page.v == v.data_ptr()
    for bad_k, bad_v, words in [(k.float(), v.float(), "16-bit"),
                                (k, v[:2], "same shape"),
                                (k.transpose(2, 3), v.transpose(2, 3), "dense"),
                                (k[0], v[0], "4-D")]:
        with pytest.raises(kvtier.InvalidArgument, match=words):
            kvtier.HostPage.of(bad_k, bad_v)

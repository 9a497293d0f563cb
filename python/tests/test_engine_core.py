"""kvtier.engine, the engine-neutral core of the vLLM and SGLang connectors,
against a real kvtierd, with CPU tensors through the CPU codec (no engine
package needed): settings, keys shared with kvtier.hf, the bounded lookup
(a stopped daemon costs at most the timeout), every KV layout, and chunks
that are missing, corrupt or of another model."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
import kvtier.torch  # noqa: E402
from conftest import Daemon, corrupt_in_pool, eventually  # noqa: E402
from kvtier import engine  # noqa: E402

LAYERS, HEADS, DIM, BLOCK = 3, 2, 16, 4
CHUNK = 8  # two blocks per chunk


@pytest.fixture
def client(daemon):
    with kvtier.Client(socket=daemon.socket) as c:
        yield c


def _stacked(layout: str, num_blocks: int, dtype=torch.bfloat16, seed: int = 0):
    """Per-layer KV tensors of ``layout`` holding integer-valued random data."""
    g = torch.Generator().manual_seed(seed)
    shape = {"flash_attn_nhd": (2, num_blocks, BLOCK, HEADS, DIM),
             "flash_attn_hnd": (2, num_blocks, HEADS, BLOCK, DIM),
             "flashinfer_nhd": (num_blocks, 2, BLOCK, HEADS, DIM),
             "flashinfer_hnd": (num_blocks, 2, HEADS, BLOCK, DIM)}[layout]
    return [torch.randint(-64, 64, shape, generator=g).to(dtype) for _ in range(LAYERS)]


def _separate(layout: str, num_blocks: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, HEADS, DIM) if layout == "nhd" else (num_blocks, HEADS, BLOCK, DIM)
    return [(torch.randint(-64, 64, shape, generator=g).to(torch.bfloat16),
             torch.randint(-64, 64, shape, generator=g).to(torch.bfloat16)) for _ in range(LAYERS)]


def _identity(codec: str = "k16v16"):
    return engine.engine_identity("tiny/model", torch.bfloat16, codec)


# ---- settings and keys --------------------------------------------------------------------


def test_settings_parse_and_reject_bad_values():
    s = engine.ConnectorSettings.from_mapping({"socket": "/x.sock", "chunk_tokens": 64,
                                               "prefill_tokens_per_s": 20000,
                                               "kv_cache_layout": "flashinfer_hnd"})
    assert s.chunk_tokens == 64 and s.prefill_tokens_per_s == 20000 and s.load_policy == "plan"
    for bad, words in [({"chunk_tokes": 64}, "unknown setting 'chunk_tokes'"),
                       ({"chunk_tokens": "64"}, "must be int"),
                       ({"chunk_tokens": True}, "must be int"),
                       ({"chunk_tokens": 0}, "positive"),
                       ({"lookup_timeout_ms": -1}, "positive"),
                       ({"layer_group": 0}, "layer_group"),
                       ({"page_threads": 0}, "page_threads"),
                       ({"page_threads": 65}, "page_threads"),
                       ({"layerwise_load": "yes"}, "must be bool"),
                       ({"load_policy": "greedy"}, "load_policy"),
                       ({"kv_cache_layout": "xyz"}, "kv_cache_layout"),
                       ({"socket": "/a", "addr": "h:1"}, "not both")]:
        with pytest.raises(ValueError, match=words):
            engine.ConnectorSettings.from_mapping(bad)
    assert engine.ConnectorSettings.from_mapping({"backend_name": "kvtier"},
                                                 ignore=("backend_name",)).codec == "k16v8"
    assert engine.ConnectorSettings.from_mapping({}).attention_doubling_tokens is None
    for value in (0, 32512, 26624.5):
        s = engine.ConnectorSettings.from_mapping({"attention_doubling_tokens": value})
        assert s.attention_doubling_tokens == value
    for bad, words in [({"attention_doubling_tokens": "32K"}, "must be a number"),
                       ({"attention_doubling_tokens": -1}, "attention_doubling_tokens"),
                       ({"attention_doubling_tokens": math.nan}, "attention_doubling_tokens"),
                       ({"attention_doubling_tokens": math.inf}, "attention_doubling_tokens")]:
        with pytest.raises(ValueError, match=words):
            engine.ConnectorSettings.from_mapping(bad)


def test_measure_prefill_rate_is_a_boolean_setting():
    assert engine.ConnectorSettings.from_mapping({}).measure_prefill_rate is False
    assert engine.ConnectorSettings.from_mapping(
        {"measure_prefill_rate": True}).measure_prefill_rate is True
    for bad in (1, "true", 0.0):
        with pytest.raises(ValueError, match="must be bool"):
            engine.ConnectorSettings.from_mapping({"measure_prefill_rate": bad})


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_prefill_rate_meter_weighs_tokens_by_position_and_skips_idle_and_small_steps():
    clock = _Clock()
    meter = engine.PrefillRateMeter(0, min_tokens=256, min_samples=3, max_gap_s=2.0,
                                    clock=clock)
    assert meter.rate() == 0.0
    for _ in range(3):  # 1024 tokens in 0.1 s each: 10240 tokens/s
        meter.step([(0, 1024)])
        clock.now += 0.1
    assert meter.rate() == 0.0  # the third step has no successor yet
    meter.step([(0, 100), (5000, 1)])  # a small step: times the third, gives no sample
    assert meter.rate() == pytest.approx(10240)
    clock.now += 0.05
    meter.step([(0, 2048)])
    clock.now += 30  # the engine went idle: no sample
    meter.step([])
    clock.now += 1
    meter.step([(0, 4096)])  # an empty step in between: the idle one gives nothing
    assert meter.rate() == pytest.approx(10240)
    # With C2, a token at position c weighs 1 + c / C2: a step of 1000 tokens at
    # [3000, 4000) with C2 = 7000 weighs 1000 * (1 + 3500 / 7000) = 1500.
    clock2 = _Clock()
    weighted = engine.PrefillRateMeter(7000, min_tokens=256, min_samples=1, clock=clock2)
    weighted.step([(3000, 1000)])
    clock2.now += 0.5
    weighted.step([])
    assert weighted.rate() == pytest.approx(3000)
    # The median of the window: one slow outlier does not move it.
    clock3 = _Clock()
    median = engine.PrefillRateMeter(0, min_tokens=1, window=5, min_samples=5, clock=clock3)
    for dt in (0.1, 0.1, 1.5, 0.1, 0.1, 0.1):
        median.step([(0, 1000)])
        clock3.now += dt
    assert median.rate() == pytest.approx(10000)


# config.json of Llama-3.1-8B and Qwen2.5-7B (the fields the helper reads).
LLAMA_31_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
               "vocab_size": 128256, "model_type": "llama"}
QWEN_25_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
              "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
              "model_type": "qwen2"}


def _c2_by_flops(h, layers, heads, kv_heads, head_dim, inter):
    """C2 = P / (2 L Hq D), P the non-embedding parameters (q, k, v, o, gated MLP)."""
    per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + \
        3 * h * inter
    return layers * per_layer / (2 * layers * heads * head_dim)


def test_attention_doubling_tokens_of_known_models():
    llama = engine.attention_doubling_tokens(LLAMA_31_8B)
    qwen = engine.attention_doubling_tokens(SimpleNamespace(**QWEN_25_7B))  # no head_dim
    assert llama == _c2_by_flops(4096, 32, 32, 8, 128, 14336) == 26624
    assert qwen == _c2_by_flops(3584, 28, 28, 4, 128, 18944) == 32512
    # Their published non-embedding parameter counts: 6.98B and 6.53B.
    assert 32 * 2 * 32 * 128 * llama == pytest.approx(6.98e9, rel=1e-3)
    assert 28 * 2 * 28 * 128 * qwen == pytest.approx(6.53e9, rel=1e-3)
    for c2 in (llama, qwen):
        assert 10_000 < c2 < 100_000
    # A transformers config object, and a multimodal config's text part.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA_31_8B.items() if k != "model_type"})
    assert engine.attention_doubling_tokens(cfg) == 26624
    assert engine.attention_doubling_tokens({"text_config": QWEN_25_7B}) == 32512
    # A mixture of experts runs num_experts_per_tok experts per token
    # (Mixtral-8x7B: 2 of 8, intermediate 14336).
    mixtral = dict(LLAMA_31_8B, num_local_experts=8, num_experts_per_tok=2)
    assert engine.attention_doubling_tokens(mixtral) == 4096 + 1024 + 2 * 1.5 * 14336
    shared = dict(QWEN_25_7B, num_experts_per_tok=4, moe_intermediate_size=2560,
                  shared_expert_intermediate_size=20480)
    assert engine.attention_doubling_tokens(shared) == 3584 + 512 + 1.5 * (4 * 2560 + 20480)
    for bad, words in [({}, "hidden_size"),
                       (dict(QWEN_25_7B, intermediate_size=None), "intermediate_size"),
                       (dict(QWEN_25_7B, num_attention_heads=0), "num_attention_heads"),
                       (dict(QWEN_25_7B, hidden_size="3584"), "hidden_size")]:
        with pytest.raises(ValueError, match=words):
            engine.attention_doubling_tokens(bad)


def test_attention_doubling_tokens_setting_wins_over_the_model_config():
    assert engine.resolve_attention_doubling_tokens(None, LLAMA_31_8B) == 26624
    assert engine.resolve_attention_doubling_tokens(0, LLAMA_31_8B) == 0.0
    assert engine.resolve_attention_doubling_tokens(1000, LLAMA_31_8B) == 1000.0
    assert engine.resolve_attention_doubling_tokens(None, None) == 0.0
    assert engine.resolve_attention_doubling_tokens(None, {"hidden_size": 64}) == 0.0


def test_identity_matches_kvtier_hf_keys():
    hf = pytest.importorskip("kvtier.hf")
    assert engine.KV_LAYOUT == hf.KV_LAYOUT
    ident = _identity("k16v8")
    tokens = list(range(100, 100 + 3 * CHUNK + 5))
    assert kvtier.chunk_keys(ident.fingerprint(), engine.token_array(tokens), CHUNK) == \
        kvtier.prefix_keys("tiny/model", tokens, CHUNK, dtype="bf16", kv_layout="hf-nhd",
                           codec="k16v8")
    with pytest.raises(ValueError, match="16-bit"):
        engine.engine_identity("m", torch.float32)
    with pytest.raises(ValueError, match="model id"):
        engine.engine_identity("", torch.float16)
    with pytest.raises(ValueError, match=r"\[0, 2\^32\)"):
        engine.token_array([1, -2])


def test_loadable_chunks_keeps_the_last_token_and_follows_the_plan():
    plan = kvtier.LoadPlan(hits=4, load_chunks=2, load_chunks_us=1.0, saved_us=2.0)
    every = engine.ConnectorSettings(chunk_tokens=CHUNK)
    assert engine.loadable_chunks(plan, every, 5 * CHUNK) == 4
    assert engine.loadable_chunks(plan, every, 4 * CHUNK) == 3  # the last token runs
    rated = engine.ConnectorSettings(chunk_tokens=CHUNK, prefill_tokens_per_s=1000.0)
    assert engine.loadable_chunks(plan, rated, 5 * CHUNK) == 2
    forced = engine.ConnectorSettings(chunk_tokens=CHUNK, prefill_tokens_per_s=1000.0,
                                      load_policy="all")
    assert engine.loadable_chunks(plan, forced, 5 * CHUNK) == 4
    assert engine.loadable_chunks(None, every, 5 * CHUNK) == 0


# ---- the bounded lookup ---------------------------------------------------------------------


def _put_chunks(client, keys, seed=0):
    kv = engine.PagedKv(_stacked("flash_attn_nhd", 2 * len(keys), seed=seed), "flash_attn_nhd")
    mover = engine.KvMover(client, kv, _identity(), CHUNK)
    for i, key in enumerate(keys):
        mover.save(key, [2 * i, 2 * i + 1])
    return kv


def test_bounded_lookup_answers_from_a_live_daemon(daemon, client):
    keys = kvtier.chunk_keys(_identity().fingerprint(), list(range(4 * CHUNK)), CHUNK)
    _put_chunks(client, keys[:2])
    settings = engine.ConnectorSettings(socket=daemon.socket, lookup_timeout_ms=2000)
    lookup = engine.BoundedLookup(settings.connect, settings.lookup_timeout_ms)
    try:
        plan = lookup.plan(keys, 0.0, CHUNK)
        assert plan.hits == 2 and plan.tiers == ["dram", "dram"]
        assert lookup.plan([], 0.0, CHUNK) is None
    finally:
        lookup.close()


def test_bounded_lookup_passes_the_attention_term(daemon, client):
    """BoundedLookup.plan hands attention_doubling_tokens to kvtierd's plan: at
    1M tokens/s an 8-token chunk recomputes in 8 us, less than its DRAM load;
    with C2 = 1 token chunk i costs 8 * (1 + 8i + 4) us: 40, 104, 168, 232."""
    keys = kvtier.chunk_keys(_identity().fingerprint(), list(range(4 * CHUNK)), CHUNK)
    _put_chunks(client, keys)
    settings = engine.ConnectorSettings(socket=daemon.socket, lookup_timeout_ms=2000)
    lookup = engine.BoundedLookup(settings.connect, settings.lookup_timeout_ms)
    try:
        linear = lookup.plan(keys, 1e6, CHUNK)
        assert linear is not None and linear.hits == 4 and linear.load_chunks == 0
        plan = lookup.plan(keys, 1e6, CHUNK, attention_doubling_tokens=1.0)
        assert plan is not None and plan.load_chunks == 4
        assert plan.saved_us == pytest.approx(40 + 104 + 168 + 232 - plan.load_chunks_us)
    finally:
        lookup.close()


def test_bounded_lookup_of_a_stopped_daemon_is_a_bounded_miss(tmp_path):
    d = Daemon(tmp_path).start()
    keys = kvtier.chunk_keys(_identity().fingerprint(), list(range(2 * CHUNK)), CHUNK)
    with kvtier.Client(socket=d.socket) as c:
        _put_chunks(c, keys)
    settings = engine.ConnectorSettings(socket=d.socket, lookup_timeout_ms=300, retry_after_ms=500)
    lookup = engine.BoundedLookup(settings.connect, settings.lookup_timeout_ms,
                                  settings.retry_after_ms)
    try:
        assert eventually(lambda: lookup.plan(keys, 0.0, CHUNK)).hits == 2  # connected
        lookup.misses = dict.fromkeys(lookup.misses, 0)
        d.pause()
        try:
            t0 = time.monotonic()
            assert lookup.plan(keys, 0.0, CHUNK) is None
            took = time.monotonic() - t0
            assert 0.25 <= took < 1.5, took
            t0 = time.monotonic()
            assert lookup.plan(keys, 0.0, CHUNK) is None  # backoff or still busy: no wait
            assert time.monotonic() - t0 < 0.1
            # The lookup's deadline or the client's own (the same length) ends it.
            assert lookup.misses["timeout"] + lookup.misses["error"] == 1
            assert lookup.misses["backoff"] + lookup.misses["busy"] == 1
        finally:
            d.resume()
        assert eventually(lambda: lookup.plan(keys, 0.0, CHUNK)).hits == 2  # recovers
    finally:
        lookup.close()
        d.kill()


def test_bounded_lookup_of_a_dead_daemon_is_a_miss(tmp_path):
    d = Daemon(tmp_path).start()
    settings = engine.ConnectorSettings(socket=d.socket, lookup_timeout_ms=500, retry_after_ms=0)
    lookup = engine.BoundedLookup(settings.connect, settings.lookup_timeout_ms,
                                  settings.retry_after_ms)
    keys = kvtier.chunk_keys(_identity().fingerprint(), list(range(CHUNK)), CHUNK)
    try:
        assert eventually(lambda: lookup.plan(keys, 0.0, CHUNK)).hits == 0
        d.kill()
        t0 = time.monotonic()
        assert lookup.plan(keys, 0.0, CHUNK) is None
        assert lookup.plan(keys, 0.0, CHUNK) is None  # reconnecting fails too
        assert time.monotonic() - t0 < 1.5
        assert lookup.misses["error"] + lookup.misses["timeout"] >= 2
    finally:
        lookup.close()


def test_bounded_lookup_without_a_socket_is_a_miss(tmp_path):
    settings = engine.ConnectorSettings(socket=str(tmp_path / "none.sock"), lookup_timeout_ms=500)
    lookup = engine.BoundedLookup(settings.connect, settings.lookup_timeout_ms, 0)
    try:
        assert eventually(lambda: lookup.plan([bytes(16)], 0.0, CHUNK) is None
                          and lookup.misses["error"] == 1)
    finally:
        lookup.close()


# ---- layouts and the mover ------------------------------------------------------------------


@pytest.mark.parametrize("layout", engine.STACKED_LAYOUTS + engine.SEPARATE_LAYOUTS)
def test_save_then_load_moves_exact_kv_in_every_layout(client, layout):
    nb = 6
    make = _separate if layout in engine.SEPARATE_LAYOUTS else _stacked
    src = engine.PagedKv(make(layout, nb, seed=1), layout)
    dst = engine.PagedKv(make(layout, nb, seed=2), layout)
    ident = _identity("k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), list(range(2 * CHUNK)), CHUNK)
    save = engine.KvMover(client, src, ident, CHUNK)
    save.save(keys[0], [4, 1])
    save.save(keys[1], [0, 5])
    # The chunk holds K [layers, tokens, heads, dim] in token order of the blocks.
    k, v = kvtier.torch.decode_chunk(client.get_bytes(keys[0]))
    assert torch.equal(k[:, :BLOCK], torch.stack([src.k[layer][4] for layer in range(LAYERS)]))
    assert torch.equal(v[:, BLOCK:], torch.stack([src.v[layer][1] for layer in range(LAYERS)]))
    load = engine.KvMover(client, dst, ident, CHUNK)
    untouched = [t[3].clone() for t in dst.k]
    result = load.load(keys, [[2, 0], [1, 4]]).finish()
    assert result.tiers == ["dram", "dram"] and result.failed == []
    for layer in range(LAYERS):
        for s, d in ((4, 2), (1, 0), (0, 1), (5, 4)):
            assert torch.equal(dst.k[layer][d], src.k[layer][s])
            assert torch.equal(dst.v[layer][d], src.v[layer][s])
        assert torch.equal(dst.k[layer][3], untouched[layer])


def test_save_many_stores_each_chunk_as_save_and_reports_each_failure(client):
    src = engine.PagedKv(_stacked("flash_attn_nhd", 6, seed=8), "flash_attn_nhd")
    ident = _identity("k16v8")
    keys = kvtier.chunk_keys(ident.fingerprint(), list(range(5 * CHUNK)), CHUNK)
    mover = engine.KvMover(client, src, ident, CHUNK)
    mover.save(keys[0], [4, 1])
    errors = mover.save_many(keys[1:5], [[4, 1], [0, 99], [2, 3], [5]])
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], ValueError) and isinstance(errors[3], ValueError)
    assert client.get_bytes(keys[1]) == client.get_bytes(keys[0])
    assert kvtier.torch.decode_chunk(client.get_bytes(keys[3]))[0].shape[1] == CHUNK
    for k in (keys[2], keys[4]):
        with pytest.raises(kvtier.NotFound):
            client.get_bytes(k)
    assert mover.save_many([], []) == []
    with pytest.raises(ValueError):
        mover.save_many(keys[:2], [[0, 1]])


def test_vllm_hnd_memory_behind_an_nhd_view_round_trips(client):
    """vLLM hands HND caches over as a logical NHD shape over permuted memory."""
    physical = _stacked("flashinfer_hnd", 4, seed=3)
    logical = [t.permute(0, 1, 3, 2, 4) for t in physical]  # [blocks, 2, block, heads, dim]
    kv = engine.PagedKv(logical)
    assert kv.layout == "flashinfer_nhd" and not logical[0].is_contiguous()
    ident = _identity()
    key = kvtier.chunk_keys(ident.fingerprint(), list(range(CHUNK)), CHUNK)[0]
    engine.KvMover(client, kv, ident, CHUNK).save(key, [3, 0])
    k, _ = kvtier.torch.decode_chunk(client.get_bytes(key))
    assert torch.equal(k[1, :BLOCK], physical[1][3, 0].transpose(0, 1))


def test_k16v8_load_is_close_and_keys_are_exact(client):
    src = engine.PagedKv(_stacked("flash_attn_nhd", 2, seed=4), "flash_attn_nhd")
    dst = engine.PagedKv(_stacked("flash_attn_nhd", 2, seed=5), "flash_attn_nhd")
    ident = _identity("k16v8")
    key = kvtier.chunk_keys(ident.fingerprint(), list(range(CHUNK)), CHUNK)[0]
    engine.KvMover(client, src, ident, CHUNK).save(key, [0, 1])
    assert engine.KvMover(client, dst, ident, CHUNK).load([key], [[1, 0]]).finish().failed == []
    for layer in range(LAYERS):
        assert torch.equal(dst.k[layer][1], src.k[layer][0])  # K stays 16-bit
        err = (dst.v[layer][0].float() - src.v[layer][1].float()).abs().max()
        assert 0 < err <= 64 * 0.07  # FP8 e4m3: ~2^-4 relative
        assert not torch.isnan(dst.v[layer]).any()


def test_missing_corrupt_and_foreign_chunks_are_reported_not_written(client):
    src = engine.PagedKv(_stacked("flash_attn_nhd", 6, seed=6))
    ident = _identity()
    keys = kvtier.chunk_keys(ident.fingerprint(), list(range(3 * CHUNK)), CHUNK)
    mover = engine.KvMover(client, src, ident, CHUNK)
    mover.save(keys[0], [0, 1])
    mover.save(keys[1], [2, 3])
    other = engine.engine_identity("other/model", torch.bfloat16, "k16v16")
    engine.KvMover(client, src, other, CHUNK).save(keys[2], [4, 5])  # stored under our key
    corrupt_in_pool(client, keys[1])
    dst = engine.PagedKv(_stacked("flash_attn_nhd", 6, seed=7))
    before = [t.clone() for t in dst.k]
    result = engine.KvMover(client, dst, ident, CHUNK).load(
        keys + [kvtier.chunk_keys(ident.fingerprint(), [7] * CHUNK, CHUNK)[0]],
        [[0, 1], [2, 3], [4, 5], [4, 5]]).finish()
    assert result.tiers[0] == "dram" and result.failed == [1, 2, 3]
    assert "DATA_LOSS" in result.errors[1]
    assert "INVALID_ARGUMENT" in result.errors[2] and "NOT_FOUND" in result.errors[3]
    for layer in range(LAYERS):
        assert torch.equal(dst.k[layer][:2], src.k[layer][:2])
        assert torch.equal(dst.k[layer][2:], before[layer][2:])
    assert client.lookup(keys[1:2]) == []  # kvtierd dropped the corrupt chunk


def test_bad_caches_and_block_ids_are_clear_errors(client):
    with pytest.raises(ValueError, match="no layers"):
        engine.PagedKv([])
    with pytest.raises(ValueError, match="cannot tell"):
        engine.PagedKv([torch.zeros(2, 2, BLOCK, HEADS, DIM, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="BF16/FP16"):
        engine.PagedKv([torch.zeros(2, 3, BLOCK, HEADS, DIM)])
    with pytest.raises(ValueError, match="dimension 1 of layer 0 must be 2"):
        engine.PagedKv(_stacked("flash_attn_nhd", 3), "flashinfer_nhd")
    with pytest.raises(ValueError, match="differs"):
        engine.PagedKv(_stacked("flash_attn_nhd", 3) + _stacked("flash_attn_nhd", 4))
    with pytest.raises(ValueError, match="5-D"):
        engine.PagedKv([torch.zeros(3, 4)])
    kv = engine.PagedKv(_stacked("flash_attn_nhd", 3))
    with pytest.raises(ValueError, match="multiple of the block size"):
        engine.KvMover(client, kv, _identity(), 6)
    with pytest.raises(ValueError, match="dtype"):
        engine.KvMover(client, kv, engine.engine_identity("m", torch.float16), CHUNK)
    mover = engine.KvMover(client, kv, _identity(), CHUNK)
    with pytest.raises(ValueError, match="outside"):
        mover.save(bytes(16), [0, 3])
    with pytest.raises(ValueError, match="do not hold"):
        mover.save(bytes(16), [0])
    with pytest.raises(ValueError, match="one block id list per key"):
        mover.load([bytes(16)], [])
    assert mover.chunk_blocks([7, 8, 9, 10], 1) == [9, 10]
    with pytest.raises(ValueError, match="needs blocks"):
        mover.chunk_blocks([7, 8, 9], 1)

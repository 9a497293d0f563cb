"""kvtier.hf on a tiny random Llama (CPU, BF16) against a real kvtierd.

The reference of a prefix reuse is the same split computation without
kvtier: prefill the cached prefix with the model, then run the rest of the
prompt with that cache. K16/V16 chunks decode bit for bit, so kvtier's logits
must equal the reference's exactly.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvtier  # noqa: E402
import kvtier.torch  # noqa: E402
from conftest import Daemon, corrupt_in_pool  # noqa: E402
from kvtier import hf, hf_paged  # noqa: E402

CHUNK = 32  # tokens per chunk: small, so prompts of a few chunks stay fast on a CPU


@pytest.fixture(scope="module")
def hf_daemon(tmp_path_factory):
    """One kvtierd for the module's tests (conftest.Daemon), with room for a few prompts."""
    d = Daemon(tmp_path_factory.mktemp("kvtierd")).start()
    yield d
    d.stop()


@pytest.fixture
def client(hf_daemon):
    with kvtier.Client(socket=hf_daemon.socket) as c:
        yield c


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama (GQA: 4 q heads, 2 kv heads), saved and loaded back
    through the checkpoint path (save_pretrained / from_pretrained)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=500000.0)
    built = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny-llama")
    built.save_pretrained(path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                          attn_implementation="sdpa")
    return loaded.eval()


_SEED = [100]


def _tokens(n: int) -> torch.Tensor:
    """Fresh random token ids [1, n] (a new prompt for every call)."""
    _SEED[0] += 1
    g = torch.Generator().manual_seed(_SEED[0])
    return torch.randint(0, 256, (1, n), generator=g)


@torch.no_grad()
def _split_reference(model, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of ids[split:] after a prefill of ids[:split] (no kvtier)."""
    if split == 0:
        return model(input_ids=ids).logits
    prefix = model(input_ids=ids[:, :split], use_cache=True)
    return model(input_ids=ids[:, split:], past_key_values=prefix.past_key_values,
                 use_cache=True).logits


def _reuse(model, client, codec="k16v16", **kw):
    return hf.PrefixReuse(model, client, codec=codec, chunk_tokens=CHUNK, **kw)


def test_identity_comes_from_the_checkpoint(model, client):
    reuse = _reuse(model, client)
    assert reuse.identity.model_id == model.config._name_or_path
    assert reuse.identity.kv_layout == hf.KV_LAYOUT
    assert reuse.identity.codec == "k16v16"
    assert reuse.identity.dtype == "bf16"
    # The codec is part of the fingerprint: k16v8 and k16v16 chunks never mix.
    assert _reuse(model, client, "k16v8").keys(_tokens(CHUNK)) != reuse.keys(_tokens(CHUNK))


def test_k16v16_reuse_is_bit_identical_to_split_prefill(model, client):
    reuse = _reuse(model, client)
    ids = _tokens(2 * CHUNK + 21)
    prefix = ids[:, :2 * CHUNK]
    first = reuse.prefill(prefix)
    assert first.loaded_tokens == 0 and first.stored_chunks == 2
    second = reuse.prefill(ids)
    assert second.loaded_tokens == 2 * CHUNK
    assert second.tiers == ["dram", "dram"]
    assert second.stored_chunks == 0
    ref = _split_reference(model, ids, 2 * CHUNK)
    assert second.logits.shape == ref.shape
    assert torch.equal(second.logits, ref)


def test_prompt_chunks_are_stored_and_a_second_request_hits(model, client):
    reuse = _reuse(model, client)
    ids = _tokens(3 * CHUNK + 5)
    keys = reuse.keys(ids)
    assert len(keys) == 3
    assert client.lookup(keys) == []
    first = reuse.prefill(ids)
    assert first.loaded_tokens == 0 and first.stored_chunks == 3
    assert client.lookup(keys) == ["dram"] * 3
    second = reuse.prefill(ids)
    assert second.loaded_tokens == 3 * CHUNK
    assert second.hits == 3 and second.stored_chunks == 0
    assert torch.equal(second.logits, _split_reference(model, ids, 3 * CHUNK))


def test_whole_cached_prompt_still_runs_its_last_chunk(model, client):
    reuse = _reuse(model, client)
    ids = _tokens(2 * CHUNK)
    reuse.prefill(ids)
    again = reuse.prefill(ids)
    # The last token's logits are the output, so at least one token runs.
    assert again.loaded_tokens == CHUNK and again.hits == 2
    assert torch.equal(again.logits, _split_reference(model, ids, CHUNK))


def test_partial_hit_loads_the_shared_chunks_only(model, client):
    reuse = _reuse(model, client)
    a = _tokens(3 * CHUNK)
    reuse.prefill(a)
    b = torch.cat([a[:, :CHUNK], _tokens(2 * CHUNK + 3)], dim=1)
    got = reuse.prefill(b)
    assert got.loaded_tokens == CHUNK and got.hits == 1 and got.stored_chunks == 2
    assert torch.equal(got.logits, _split_reference(model, b, CHUNK))
    assert client.lookup(reuse.keys(b)) == ["dram"] * 3


def test_miss_runs_the_whole_prompt(model, client):
    reuse = _reuse(model, client)
    ids = _tokens(CHUNK + 7)
    got = reuse.prefill(ids, store=False)
    assert got.loaded_tokens == 0 and got.hits == 0 and got.stored_chunks == 0
    assert torch.equal(got.logits, _split_reference(model, ids, 0))
    assert client.lookup(reuse.keys(ids)) == []


def test_corrupt_chunk_falls_back_to_recompute(model, client):
    reuse = _reuse(model, client)
    ids = _tokens(3 * CHUNK + 9)
    reuse.prefill(ids)
    keys = reuse.keys(ids)
    corrupt_in_pool(client, keys[1])
    got = reuse.prefill(ids)
    # Chunk 0 loads; chunk 1 is DataLoss (kvtierd drops it), so the prompt
    # from chunk 1 on is recomputed, and chunks 1 and 2 are stored again.
    assert got.loaded_tokens == CHUNK
    assert got.stored_chunks == 2
    assert torch.equal(got.logits, _split_reference(model, ids, CHUNK))
    assert client.lookup(keys) == ["dram"] * 3
    again = reuse.prefill(ids)
    assert again.loaded_tokens == 3 * CHUNK
    assert torch.equal(again.logits, _split_reference(model, ids, 3 * CHUNK))


def test_k16v8_reuse_is_close_to_split_prefill(model, client):
    reuse = _reuse(model, client, "k16v8")
    ids = _tokens(2 * CHUNK + 17)
    reuse.prefill(ids[:, :2 * CHUNK])
    got = reuse.prefill(ids)
    assert got.loaded_tokens == 2 * CHUNK
    ref = _split_reference(model, ids, 2 * CHUNK).float()
    err = ((got.logits.float() - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.05


def test_load_plan_can_decline_the_prefix(model, client):
    # With an absurdly fast prefill, recomputing beats loading every chunk.
    reuse = _reuse(model, client, prefill_tokens_per_s=1e15)
    ids = _tokens(2 * CHUNK + 1)
    reuse.prefill(ids)
    got = reuse.prefill(ids)
    assert got.hits == 2 and got.loaded_tokens == 0 and got.stored_chunks == 0
    assert got.plan.load_chunks == 0


def test_load_plan_prices_attention_from_the_model_config(model, client):
    """PrefixReuse takes C2 from model.config (the tiny Llama: (2*64*64 +
    2*64*32 + 3*64*128) / (2*64) = 288 tokens) unless given. At 2M tokens/s a
    32-token chunk recomputes in 16 us by tokens alone, less than its DRAM
    load (~21 us); with the attention term chunk i costs 16 * (1 + (32i + 16)
    / 288) us, so the 8 chunks of a long prompt are worth loading."""
    derived = _reuse(model, client, prefill_tokens_per_s=2e6)
    linear = _reuse(model, client, prefill_tokens_per_s=2e6, attention_doubling_tokens=0)
    assert derived.attention_doubling_tokens == 288
    assert linear.attention_doubling_tokens == 0
    ids = _tokens(8 * CHUNK + 1)
    assert linear.prefill(ids).stored_chunks == 8
    keys = derived.keys(ids)
    assert linear.plan(keys, ids.shape[1])[:2] == (0, 8)
    chunks, hits, plan = derived.plan(keys, ids.shape[1])
    assert (chunks, hits) == (8, 8) and plan.load_chunks == 8


def test_generate_continues_from_the_fetched_cache(model, client):
    reuse = _reuse(model, client)
    ids = _tokens(2 * CHUNK + 4)
    reuse.prefill(ids[:, :2 * CHUNK])
    fetched = reuse.fetch(ids)
    assert fetched.tokens == 2 * CHUNK
    out = model.generate(ids, past_key_values=fetched.cache, max_new_tokens=4, do_sample=False,
                         min_new_tokens=4, attention_mask=torch.ones_like(ids))
    assert out.shape == (1, ids.shape[1] + 4) and torch.equal(out[:, :ids.shape[1]], ids)
    # generate's first step ran the prompt's last 4 tokens on the fetched prefix.
    step = _split_reference(model, ids, 2 * CHUNK)[:, -1].argmax(-1)
    assert out[0, ids.shape[1]].item() == step.item()
    assert fetched.cache.get_seq_length() == ids.shape[1] + 3


# ---- way (b): the fetched prefix kept K16/V8 in a paged cache ----------------------

@pytest.fixture(scope="module")
def paged_model(model):
    """The tiny Llama with kvtier's paged attention (SDPA for other caches)."""
    import copy  # noqa: PLC0415
    m = copy.deepcopy(model)
    m.set_attn_implementation(hf_paged.ATTENTION)
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_paged_cache_holds_the_chunk_bytes_as_fetched(model, client):
    reuse = _reuse(model, client, "k16v8")
    g = reuse.geometry
    torch.manual_seed(3)
    shape = (g.num_layers, CHUNK, g.num_kv_heads, g.head_dim)
    k = torch.randn(shape).to(torch.bfloat16)
    v = (torch.randn(shape) * 3).to(torch.bfloat16)
    chunk = kvtier.torch.encode_chunk(reuse.chunk_spec(), k, v)
    cache = hf_paged.PagedKvCache.for_model(model, batch=2, max_tokens=2 * CHUNK)
    cache.load_chunk(memoryview(chunk), CHUNK, sequences=[1])
    cache.set_prefix(2 * CHUNK)
    blocks = cache.block_table[1, CHUNK // 16:2 * CHUNK // 16]
    codes, scales = hf_paged.quantize_blocks(v.float().view(g.num_layers, -1, 16, *shape[2:]))
    _, v_decoded = kvtier.torch.decode_chunk(chunk)
    for layer in range(g.num_layers):
        held = cache.layers[layer]
        assert torch.equal(held.keys[blocks].flatten(0, 1), k[layer])
        # The codec's FP8 codes and scales, byte for byte (quantize_blocks is the same rule).
        assert torch.equal(held.values[blocks].view(torch.uint8), codes[layer].view(torch.uint8))
        assert torch.equal(held.v_scales[blocks], scales[layer])
        gk, gv = cache.gather(layer)
        assert torch.equal(gv[1].transpose(0, 1)[CHUNK:], v_decoded[layer])
        assert torch.equal(gk[1].transpose(0, 1)[CHUNK:], k[layer])


@pytest.mark.parametrize("codec", ["k16v16", "k16v8"])
def test_paged_reuse_prefill_and_decode_match_the_dynamic_cache(model, paged_model, client, codec):
    ids = _tokens(2 * CHUNK + 11)
    _reuse(model, client, codec).prefill(ids[:, :2 * CHUNK])
    reuse = hf_paged.PagedPrefixReuse(paged_model, client, codec=codec, chunk_tokens=CHUNK,
                                      max_new_tokens=8, batch=1)
    got = reuse.prefill(ids)
    assert got.loaded_tokens == 2 * CHUNK and got.tiers == ["dram", "dram"]
    assert isinstance(got.past_key_values, hf_paged.PagedKvCache)
    ref = _reuse(model, client, codec).prefill(ids, store=False)
    assert ref.loaded_tokens == 2 * CHUNK
    # K16/V16 blocks hold the dynamic cache's bits: the same attention inputs.
    close = torch.equal if codec == "k16v16" else (lambda x, y: _rel(x, y) < 0.05)
    assert close(got.logits, ref.logits)
    # Decode steps on both caches from the same tokens.
    paged, dyn = got.past_key_values, ref.past_key_values
    token = ref.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        for _ in range(4):
            a = model(input_ids=token, past_key_values=dyn, use_cache=True).logits
            b = paged_model(input_ids=token, past_key_values=paged, use_cache=True).logits
            assert close(b, a)
            token = a[:, -1:].argmax(-1)
    assert paged.seq_len == ids.shape[1] + 4


def test_paged_cache_decodes_a_batch(paged_model, client):
    ids = _tokens(CHUNK + 5)
    cache = hf_paged.PagedKvCache.for_model(paged_model, batch=3, max_tokens=CHUNK + 16)
    batch = ids.expand(3, -1)
    with torch.no_grad():
        first = paged_model(input_ids=batch, past_key_values=cache, use_cache=True).logits
        step = paged_model(input_ids=first[:, -1:].argmax(-1), past_key_values=cache,
                           use_cache=True).logits
    assert cache.seq_len == CHUNK + 6
    assert torch.equal(step[0], step[1]) and torch.equal(step[1], step[2])
    with torch.no_grad():
        one = paged_model(input_ids=ids, use_cache=True)
        ref = paged_model(input_ids=first[:1, -1:].argmax(-1),
                          past_key_values=one.past_key_values, use_cache=True).logits
    assert _rel(step[:1], ref) < 0.05


def test_layerwise_cache_waits_for_each_layer_before_using_it(model):
    waited = []
    cache = hf.LayerwiseDynamicCache(model.config, waited.append, 2)
    k = torch.zeros(1, 2, 3, 16, dtype=torch.bfloat16)
    for layer in range(2):
        cache.layers[layer].lazy_initialization(k, k)
        cache.layers[layer].keys, cache.layers[layer].values = k.clone(), k.clone()
    with torch.no_grad():
        model(input_ids=_tokens(4), past_key_values=cache, use_cache=True)
    assert waited == [0, 1]
    assert cache.get_seq_length() == 7
    cache.wait_all()
    assert waited == [0, 1]


# ---- GPU (skipped without a CUDA device and a libkvtier with the GPU path) ----------

def _gpu_ready() -> bool:
    return torch.cuda.is_available() and kvtier.has_cuda()


gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA device and libkvtier with CUDA")


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    """A small random Llama on the GPU whose head_dim (64) the kernels support."""
    if not _gpu_ready():
        pytest.skip("needs a CUDA device and libkvtier with CUDA")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("small-llama")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").eval()


@gpu
def test_gpu_layerwise_k16v16_reuse_is_bit_identical_to_split_prefill(gpu_model, client):
    reuse = _reuse(gpu_model, client)
    ids = _tokens(3 * CHUNK + 13)
    reuse.prefill(ids[:, :3 * CHUNK])          # stored from the GPU cache
    got = reuse.prefill(ids)                   # loaded layer by layer on a side stream
    assert got.loaded_tokens == 3 * CHUNK and got.tiers == ["dram"] * 3
    ref = _split_reference(gpu_model, ids.cuda(), 3 * CHUNK)
    assert torch.equal(got.logits, ref)
    # The GPU store wrote the same chunk bytes the CPU codec decodes.
    k, v = kvtier.torch.decode_chunk(client.get_bytes(reuse.keys(ids)[1]))
    pre = gpu_model(input_ids=ids[:, :3 * CHUNK].cuda(), use_cache=True).past_key_values
    ck, cv = hf.chunk_tensors(pre, 1, CHUNK)
    assert torch.equal(k, ck.cpu()) and torch.equal(v, cv.cpu())


@gpu
def test_gpu_corrupt_chunk_in_a_layerwise_load_falls_back(gpu_model, client):
    reuse = _reuse(gpu_model, client)
    ids = _tokens(3 * CHUNK + 2)
    reuse.prefill(ids)
    corrupt_in_pool(client, reuse.keys(ids)[2])
    got = reuse.prefill(ids)
    assert got.loaded_tokens == 2 * CHUNK and got.stored_chunks == 1
    assert torch.equal(got.logits, _split_reference(gpu_model, ids.cuda(), 2 * CHUNK))


@gpu
def test_gpu_paged_decode_kernel_matches_the_dynamic_cache(gpu_model, client):
    import copy  # noqa: PLC0415
    paged_model = copy.deepcopy(gpu_model)
    paged_model.set_attn_implementation(hf_paged.ATTENTION)
    ids = _tokens(2 * CHUNK + 7)
    _reuse(gpu_model, client, "k16v8").prefill(ids[:, :2 * CHUNK])
    reuse = hf_paged.PagedPrefixReuse(paged_model, client, codec="k16v8", chunk_tokens=CHUNK,
                                      max_new_tokens=8, batch=4)
    got = reuse.prefill(ids)
    ref = _reuse(gpu_model, client, "k16v8").prefill(ids, store=False)
    dyn = ref.past_key_values
    dyn.batch_repeat_interleave(4)
    token = ref.logits[:, -1:].argmax(-1).expand(4, 1)
    assert hf_paged.kernel_available()
    with torch.no_grad():
        for _ in range(4):
            a = gpu_model(input_ids=token, past_key_values=dyn, use_cache=True).logits
            b = paged_model(input_ids=token, past_key_values=got.past_key_values,
                            use_cache=True).logits
            assert not torch.isnan(b).any()
            assert _rel(b, a) < 0.05
            token = a[:, -1:].argmax(-1)


def test_keys_of_an_array_of_token_ids_equal_those_of_a_list(model, client):
    import array  # noqa: PLC0415
    reuse = _reuse(model, client)
    ids = _tokens(3 * CHUNK + 7)[0].tolist()
    fp = reuse.identity.fingerprint()
    assert kvtier.chunk_keys(fp, array.array("I", ids), CHUNK) == kvtier.chunk_keys(fp, ids, CHUNK)
    assert kvtier.chunk_keys(fp, array.array("I", ids), CHUNK, partial=True) == \
        kvtier.prefix_keys(reuse.identity, ids, CHUNK, partial=True)
    assert reuse.keys(ids) == kvtier.prefix_keys(reuse.identity, ids, CHUNK)

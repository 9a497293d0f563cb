"""One prefix, three engines: saved through the vLLM connector (vLLM's own
scheduler, test_vllm_connector.Engine), then found and loaded with identical
keys by kvtier.hf (a Hugging Face Llama of the same config) and by the SGLang
backend (SGLang's factory and host pool, in the SGLang venv's Python through
sglang_fetch.py: the two engines pin different torch releases).

Runs in the vLLM venv; ctest sets KVTIER_SGLANG_PYTHON to the SGLang venv's
interpreter."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch
import transformers

import kvtier
from conftest import Daemon
from kvtier import engine, hf
from test_vllm_connector import BLOCK, CHUNK, DIM, HEADS, LAYERS, _prompt, _save_prompt

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved with its weights: vLLM reads its config, kvtier.hf loads it."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=HEADS * DIM * 2, intermediate_size=64,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS * 2, num_key_value_heads=HEADS,
        head_dim=DIM, max_position_embeddings=4096, torch_dtype="bfloat16", eos_token_id=255)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.fixture
def kvtierd(tmp_path):
    d = Daemon(tmp_path).start()
    yield d
    d.kill()


def test_prefix_saved_by_vllm_is_loaded_by_kvtier_hf_and_sglang(model_dir, kvtierd, tmp_path):
    tokens = _prompt(3 * CHUNK + 5, 11)
    k, v = _save_prompt(model_dir, kvtierd, tokens)  # vLLM: [layers, tokens, heads, dim]
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)
    assert len(keys) == 3

    # kvtier.hf: the same keys, the prefix fetched into a DynamicCache.
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with kvtier.Client(socket=kvtierd.socket) as client:
        reuse = hf.PrefixReuse(model, client, codec="k16v16", chunk_tokens=CHUNK,
                               block_size=BLOCK)
        assert reuse.keys(tokens) == keys
        fetched = reuse.fetch(torch.tensor([tokens]))
        assert fetched.tokens == 3 * CHUNK and fetched.tiers == ["dram"] * 3
        for layer in range(LAYERS):
            got = fetched.cache.layers[layer]
            assert torch.equal(got.keys[0].transpose(0, 1), k[layer, :3 * CHUNK])
            assert torch.equal(got.values[0].transpose(0, 1), v[layer, :3 * CHUNK])
        # The fetched prefix serves a prefill: logits of the rest equal a full prefill's
        # split the same way (K16/V16 is lossless).
        result = reuse.prefill(torch.tensor([tokens]), store=False)
        assert result.loaded_tokens == 3 * CHUNK

    # SGLang: the same keys (as kvtier keys), the pages loaded into its host pool.
    python = os.environ.get("KVTIER_SGLANG_PYTHON")
    assert python, "KVTIER_SGLANG_PYTHON (the SGLang venv's python) is not set"
    out = tmp_path / "sglang.pt"
    subprocess.run([python, os.path.join(HERE, "sglang_fetch.py"), kvtierd.socket, model_dir,
                    str(CHUNK), str(LAYERS), str(HEADS), str(DIM), str(out),
                    *[kvtier.key_hex(key) for key in keys]],
                   check=True, timeout=300, env={**os.environ, "PYTHONPATH": HERE})
    got = torch.load(out)
    assert got["keys"] == [kvtier.key_hex(key) for key in keys]
    assert got["hits"] == 3 and got["ok"] == [True] * 3
    for i in range(3):
        assert torch.equal(got["k"][i], k[:, i * CHUNK:(i + 1) * CHUNK])
        assert torch.equal(got["v"][i], v[:, i * CHUNK:(i + 1) * CHUNK])

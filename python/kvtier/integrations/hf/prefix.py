"""Prefix reuse for Hugging Face transformers causal LMs (Llama, Qwen, Mistral; GQA).

Before a prefill, the longest cached prefix of the prompt (whole chunks of
``chunk_tokens`` tokens) is fetched from kvtierd into the model's cache, only
the rest of the prompt runs through the model, and the prompt's new full
chunks are stored afterwards:

    import kvtier, kvtier.hf
    client = kvtier.Client(socket="./kvtier-data/kvtierd.sock")
    reuse = kvtier.hf.PrefixReuse(model, client, codec="k16v8")
    result = reuse.prefill(input_ids)            # logits of the prompt's run part
    out = model.generate(input_ids, past_key_values=result.past_key_values, ...)

or, around ``generate`` alone:

    cache = reuse.fetch(input_ids).cache         # DynamicCache holding the prefix
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    reuse.store(input_ids, cache)

Two ways to hold what was fetched:
  (a) ``PrefixReuse`` decodes it into the model's usual 16-bit ``DynamicCache``
      (K and V [batch, kv_heads, seq, head_dim]);
  (b) ``kvtier.hf_paged.PagedPrefixReuse`` keeps it as fetched (K16, V in FP8
      with per-(block, head) scales) in a paged cache whose decode attention
      reads those blocks directly.

A chunk holds K and V [layers, tokens, kv_heads, head_dim] of all layers,
after RoPE, in the model's dtype (BF16 or FP16). Keys come from
``kvtier.prefix_keys`` over the token ids with the identity of
``model_identity``; the chunk bytes do not depend on the way that holds them,
so both ways share one kv_layout (``KV_LAYOUT``).

Where the fetch runs: on a CPU model through the CPU codec (get, verify,
decode); on a CUDA model through ``kvtier.torch.load_layerwise`` when the
library has the GPU path: the layers arrive on a side stream and layer l is
waited for (an event, no host sync) when the model's layer l first touches its
cache, so loading overlaps the suffix's compute.
"""
from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicCache

import kvtier
import kvtier.torch as kvtorch
from kvtier.integrations.engine import KV_LAYOUT, UNUSABLE, resolve_attention_doubling_tokens
from kvtier.integrations.hf import _gpu
from kvtier.integrations.hf.cache import Fetched, LayerwiseDynamicCache, kv_layers
from kvtier.torch import DTYPE_NAMES

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclasses.dataclass(frozen=True)
class KvGeometry:
    """What one layer's KV of the model looks like."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def kv_geometry(model: PreTrainedModel) -> KvGeometry:
    """Layers, KV heads, head dim and 16-bit dtype of a transformers causal LM.

    Raises ValueError for a model whose KV is not 16-bit or whose layers are
    not all full attention (sliding-window and linear-attention layers are
    not cached by kvtier).
    """
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"kvtier.hf caches full-attention layers only, not {set(layer_types)}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = model.dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"kvtier.hf needs a BF16 or FP16 model, not {dtype}")
    return KvGeometry(config.num_hidden_layers, getattr(config, "num_key_value_heads", heads),
                      head_dim, dtype)


def model_identity(model: PreTrainedModel, codec: str = "k16v8", *, model_id: str | None = None,
                   revision: str | None = None, kv_layout: str = KV_LAYOUT) -> kvtier.ModelIdentity:
    """The kvtier identity of a model's KV: what its chunk keys are derived from.

    model_id defaults to the config's name_or_path (the hub id or the local
    directory it was loaded from), revision to the commit hash transformers
    recorded when it loaded the checkpoint ("" if none).
    """
    config = model.config
    if model_id is None:
        model_id = getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not model_id:
        raise ValueError("the model has no name_or_path: pass model_id")
    if revision is None:
        revision = getattr(config, "_commit_hash", None) or ""
    return kvtier.ModelIdentity(model_id=str(model_id), revision=str(revision),
                                dtype=DTYPE_NAMES[kv_geometry(model).dtype],
                                kv_layout=kv_layout, codec=codec)


@dataclasses.dataclass
class PrefillResult:
    """What PrefixReuse.prefill returns.

    logits: [1, run_tokens, vocab] (or [1, 1, vocab] with last_logits_only).
    past_key_values: the cache after the prefill (prompt length tokens).
    hidden_states: the model's last hidden state [1, run_tokens, hidden] when asked for.
    loaded_tokens: prompt tokens fetched from kvtier; run_tokens = prompt - loaded_tokens.
    stored_chunks: full chunks of the prompt stored after the prefill.
    tiers, hits, plan: as Fetched.
    """
    logits: torch.Tensor
    past_key_values: Cache
    hidden_states: torch.Tensor | None
    loaded_tokens: int
    stored_chunks: int
    tiers: list
    hits: int
    plan: kvtier.LoadPlan | None


def chunk_tensors(cache: Cache, chunk: int, chunk_tokens: int, batch_index: int = 0):
    """K and V of one chunk of a cache: CPU-or-device tensors [layers, tokens, heads, dim].

    Tokens [chunk * chunk_tokens, (chunk + 1) * chunk_tokens) of sequence
    ``batch_index`` of every layer, contiguous.
    """
    begin, end = chunk * chunk_tokens, (chunk + 1) * chunk_tokens
    layers = kv_layers(cache)
    ks = [layer.keys[batch_index, :, begin:end, :].transpose(0, 1) for layer in layers]
    vs = [layer.values[batch_index, :, begin:end, :].transpose(0, 1) for layer in layers]
    return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()


class PrefixReuse:
    """Prefix reuse for one transformers causal LM through one kvtier client (way (a)).

    model: a transformers causal LM in BF16 or FP16 whose layers are all full
      attention (Llama, Qwen2, Mistral without sliding window, ...).
    client: a connected kvtier.Client.
    codec: the chunk codec, "k16v8" (V in FP8, lossy) or "k16v16" (lossless).
    chunk_tokens: tokens per chunk (a multiple of block_size).
    block_size: the codec's scale block, in tokens (per-(block, head) V scales).
    prefill_tokens_per_s: the model's prefill rate, tokens/s, at short context
      (a few hundred tokens; at the prompt's context with
      attention_doubling_tokens 0); with a rate, kvtierd's plan decides how many
      cached chunks are worth loading (load or recompute), without one every
      cached chunk is loaded.
    attention_doubling_tokens: C2, the context length in tokens at which one
      token's prefill costs twice its short-context cost, so that the plan
      prices the later chunks of a long prefix higher
      (``kvtier.Client.plan_load``); 0 prices every token alike. Default:
      derived from model.config (``kvtier.engine.attention_doubling_tokens``),
      0 when the config does not tell.
    model_id, revision: override the identity's (see model_identity).
    layerwise: on a CUDA model with the GPU path, overlap the load with the
      suffix's compute layer by layer (default True).
    layer_group: layers per step of that load (one decode launch per chunk and
      group, all enqueued before the model's forward is): larger groups enqueue
      fewer launches, smaller ones let the first layers start sooner. Default 4.

    Not thread-safe: one prefill at a time per object.
    """

    def __init__(self, model: PreTrainedModel, client: kvtier.Client, *, codec: str = "k16v8",
                 chunk_tokens: int = 256, block_size: int = 16, prefill_tokens_per_s: float = 0.0,
                 attention_doubling_tokens: float | None = None,
                 model_id: str | None = None, revision: str | None = None,
                 layerwise: bool = True, layer_group: int = 4):
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a positive multiple of "
                             f"{block_size}")
        self.model = model
        self.client = client
        self.codec = codec
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.attention_doubling_tokens = resolve_attention_doubling_tokens(
            attention_doubling_tokens, getattr(model, "config", None))
        self.layerwise = layerwise
        self.layer_group = layer_group
        self.geometry = kv_geometry(model)
        self.identity = model_identity(model, codec, model_id=model_id, revision=revision)
        self._fingerprint = self.identity.fingerprint()

    # ---- keys and plan -------------------------------------------------------

    @staticmethod
    def _token_list(input_ids) -> array.array:
        """The prompt's token ids as array('I') (what kvtier.chunk_keys takes as it is)."""
        if isinstance(input_ids, array.array) and input_ids.typecode == "I":
            return input_ids
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 2:
                if input_ids.shape[0] != 1:
                    raise ValueError("kvtier.hf handles one prompt at a time (batch 1)")
                input_ids = input_ids[0]
            input_ids = input_ids.tolist()
        return array.array("I", input_ids)  # OverflowError outside [0, 2^32)

    def keys(self, input_ids) -> list:
        """Keys (bytes(16) each) of the prompt's full chunks."""
        tokens = self._token_list(input_ids)
        if not tokens:
            return []
        return kvtier.chunk_keys(self._fingerprint, tokens, self.chunk_tokens)

    def chunk_spec(self) -> kvtier.ChunkSpec:
        """The ChunkSpec of this model's chunks."""
        g = self.geometry
        return kvtier.ChunkSpec(fingerprint=self._fingerprint, num_layers=g.num_layers,
                                num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                                num_tokens=self.chunk_tokens, block_size=self.block_size,
                                dtype=DTYPE_NAMES[g.dtype], codec=self.codec)

    def plan(self, keys: Sequence, num_tokens: int):
        """(chunks to load, hits, LoadPlan) for a prompt of num_tokens with these keys.

        At most (num_tokens - 1) // chunk_tokens chunks: the prompt's last token
        always runs, since its logits are the prefill's output.
        """
        if not keys:
            return 0, 0, None
        plan = self.client.plan_load(keys, self.prefill_tokens_per_s, self.chunk_tokens,
                                     self.attention_doubling_tokens)
        chunks = plan.load_chunks if self.prefill_tokens_per_s > 0 else plan.hits
        return min(chunks, (num_tokens - 1) // self.chunk_tokens), plan.hits, plan

    # ---- fetch ---------------------------------------------------------------

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def fetch(self, input_ids, max_chunks: int | None = None, *,
              overlap: bool = False) -> Fetched:
        """Loads the longest usable cached prefix of the prompt into a new model cache.

        Returns a Fetched whose cache is empty (tokens 0) on a miss. A chunk
        that is missing, corrupt (DataLoss: kvtierd drops it) or of another
        geometry ends the prefix there; the prompt's remaining tokens are then
        recomputed by the prefill.

        overlap (GPU path only): return while the layers are still arriving;
        the cache waits for each layer on the device when the model first uses
        it, and its ``finish()`` (after the forward) tells each chunk's tier, or
        None for a chunk that could not be used, whose tokens the forward then
        read unfilled (``prefill`` repeats the run in that case). Without
        overlap the load is finished and checked before returning.
        """
        tokens = self._token_list(input_ids)
        keys = self.keys(tokens)
        chunks, hits, plan = self.plan(keys, len(tokens))
        if max_chunks is not None:
            chunks = min(chunks, max_chunks)
        device = self._device()
        if chunks and device.type == "cuda" and self.layerwise and kvtier.has_cuda():
            return self._fetch_gpu(keys, chunks, hits, plan, device, overlap)
        return self._fetch_cpu(keys, chunks, hits, plan, device)

    def _decode_chunks(self, keys: Sequence):
        """(list of (k, v) CPU tensors [layers, tokens, heads, dim], tiers) of the usable
        leading chunks."""
        g = self.geometry
        want = (g.num_layers, self.chunk_tokens, g.num_kv_heads, g.head_dim)
        out, tiers = [], []
        for key in keys:
            try:
                with self.client.get(key) as chunk:
                    # A chunk of another model, codec, dtype or revision under this key
                    # (its writer's fingerprint is in the header) is a miss, never mixed in.
                    if kvtier.codec.read_header(chunk.data).fingerprint != self._fingerprint:
                        break
                    k, v = kvtorch.decode_chunk(chunk.data)
                    tier = chunk.tier
            except UNUSABLE:
                break
            if tuple(k.shape) != want or k.dtype != g.dtype:
                break
            out.append((k, v))
            tiers.append(tier)
        return out, tiers

    def _fetch_cpu(self, keys, chunks, hits, plan, device) -> Fetched:
        decoded, tiers = self._decode_chunks(keys[:chunks])
        cached = hits if len(decoded) == chunks else len(decoded)
        cache = DynamicCache(config=self.model.config)
        if decoded:
            for layer in range(self.geometry.num_layers):
                # [tokens, heads, dim] per chunk -> [1, heads, prefix, dim]
                k = torch.cat([kv[0][layer] for kv in decoded]).transpose(0, 1).unsqueeze(0)
                v = torch.cat([kv[1][layer] for kv in decoded]).transpose(0, 1).unsqueeze(0)
                cache.update(k.to(device), v.to(device), layer)
        return Fetched(cache, len(decoded) * self.chunk_tokens, keys, tiers, hits, plan, cached)

    def _fetch_gpu(self, keys, chunks, hits, plan, device, overlap) -> Fetched:
        return _gpu.fetch_layerwise(self, keys, chunks, hits, plan, device, overlap)

    # ---- store ---------------------------------------------------------------

    def store(self, input_ids, cache: Cache, *, first_chunk: int = 0, durable: bool = False) -> int:
        """Stores the prompt's full chunks [first_chunk, ...) held by ``cache``.

        ``cache`` holds at least the prompt's tokens (sequence 0 of its batch);
        tokens past the prompt (generated ones) are not stored. Returns the
        number of chunks stored. Errors of a put propagate (kvtier.KvtierError).
        """
        tokens = self._token_list(input_ids)
        keys = self.keys(tokens)
        if hasattr(cache, "finish"):
            cache.finish()
        elif isinstance(cache, LayerwiseDynamicCache):
            cache.wait_all()
        held = min(len(keys), cache.get_seq_length() // self.chunk_tokens)
        if first_chunk >= held:
            return 0
        device = kv_layers(cache)[0].keys.device
        if device.type == "cuda" and kvtier.has_cuda():
            return _gpu.store_chunks(self, keys, cache, first_chunk, held, durable)
        spec = self.chunk_spec()
        for i in range(first_chunk, held):
            k, v = chunk_tensors(cache, i, self.chunk_tokens)
            self.client.put(keys[i], kvtorch.encode_chunk(spec, k.cpu(), v.cpu()), durable=durable)
        return held - first_chunk

    # ---- prefill -------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids, *, store: bool = True, last_logits_only: bool = False,
                output_hidden_state: bool = False, max_chunks: int | None = None,
                **forward_kwargs) -> PrefillResult:
        """Fetch, run the rest of the prompt, store the prompt's new full chunks.

        input_ids: [1, n] or [n] token ids (batch 1). The model runs tokens
        [loaded, n) with the fetched cache; positions continue from the
        prefix. Returns a PrefillResult. store=False skips the store.
        """
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        fetched = self.fetch(ids, max_chunks=max_chunks, overlap=True)
        out = self._run(ids[:, fetched.tokens:], fetched.cache, last_logits_only,
                        output_hidden_state, forward_kwargs)
        finish = getattr(fetched.cache, "finish", None)
        if finish is not None:
            # A layer-by-layer load reports missing or corrupt chunks only once it is
            # done: the run used them, so it is repeated on the chunks before the first.
            tiers = finish()
            fetched.tiers = list(tiers)
            if None in tiers:
                good = tiers.index(None)
                result = self.prefill(ids, store=False, last_logits_only=last_logits_only,
                                      output_hidden_state=output_hidden_state,
                                      max_chunks=good, **forward_kwargs)
                if store:  # kvtierd dropped the corrupt chunk: store from there on
                    result.stored_chunks = self.store(ids, result.past_key_values,
                                                      first_chunk=good)
                return result
        hidden = out.hidden_states[-1] if output_hidden_state else None
        stored = 0
        if store:
            # Chunks kvtierd already holds are not put again.
            stored = self.store(ids, out.past_key_values, first_chunk=fetched.cached)
        return PrefillResult(out.logits, out.past_key_values, hidden, fetched.tokens, stored,
                             fetched.tiers, fetched.hits, fetched.plan)

    def _run(self, run_ids, cache, last_logits_only, output_hidden_state, forward_kwargs):
        kwargs = dict(forward_kwargs)
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=run_ids.to(self._device()), past_key_values=cache,
                          use_cache=True, output_hidden_states=output_hidden_state, **kwargs)


__all__ = ["PrefixReuse", "PrefillResult", "Fetched", "LayerwiseDynamicCache", "KvGeometry",
           "kv_geometry", "model_identity", "chunk_tensors", "KV_LAYOUT"]

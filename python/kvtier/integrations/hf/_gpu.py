"""The GPU half of kvtier.hf: layer-by-layer fetch into a DynamicCache, store
from it, and the paged decode attention of kvtier.hf_paged, over the GPU path
of kvtier.torch (libkvtier's kernels reading and writing kvtierd's pinned
pool directly). Called only for CUDA models with a libkvtier that has CUDA.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kvtier.torch as kvtorch
from kvtier.integrations.hf.cache import Fetched, LayerwiseDynamicCache, kv_layers

if TYPE_CHECKING:
    from kvtier.integrations.hf.prefix import PrefixReuse


def _span(chunk: int, chunk_tokens: int, block_size: int) -> list:
    """Block ids of chunk `chunk` of a contiguous cache seen as blocks of block_size."""
    per = chunk_tokens // block_size
    return list(range(chunk * per, (chunk + 1) * per))


class _Finishing(LayerwiseDynamicCache):
    """LayerwiseDynamicCache that finishes its LayerwiseLoad once every layer was waited for."""

    def __init__(self, config, load, num_layers: int, side_stream, paged):
        super().__init__(config, self._wait, num_layers)
        self._load = load
        self._side = side_stream
        self._paged = paged  # the descriptor lives as long as the load may write
        self.load_tiers: list | None = None

    def _wait(self, layer: int) -> None:
        self._load.wait_layer(layer, stream=torch.cuda.current_stream())

    def finish(self) -> list:
        """Every layer waited for, the chunks released: each chunk's tier, None for a
        chunk that was missing or corrupt (its tokens in the cache are not valid)."""
        self.wait_all()
        if self.load_tiers is None:
            self.load_tiers = self._load.finish()
        return self.load_tiers


def fetch_layerwise(reuse: PrefixReuse, keys, chunks: int, hits: int, plan, device,
                    overlap: bool):
    """Starts loading chunks [0, chunks) into preallocated [1, heads, prefix, dim]
    layers of a DynamicCache on a side stream. With overlap, returns a Fetched
    whose cache waits for layer l when the model's layer l first uses it (the
    chunks' status is known after the forward: finish()). Without, finishes
    the load and keeps the chunks before the first that could not be used."""
    g = reuse.geometry
    prefix = chunks * reuse.chunk_tokens
    shape = (1, g.num_kv_heads, prefix, g.head_dim)
    ks = [torch.empty(shape, dtype=g.dtype, device=device) for _ in range(g.num_layers)]
    vs = [torch.empty(shape, dtype=g.dtype, device=device) for _ in range(g.num_layers)]
    paged = kvtorch.PagedCache.from_contiguous(ks, vs, block_size=reuse.block_size)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))  # the tensors exist before the decode
    spans = [_span(i, reuse.chunk_tokens, reuse.block_size) for i in range(chunks)]
    load = kvtorch.load_layerwise(reuse.client, keys[:chunks], paged, spans,
                                  layer_group=min(reuse.layer_group, g.num_layers), stream=side)
    cache = _Finishing(reuse.model.config, load, g.num_layers, side, paged)
    layers = kv_layers(cache)
    for i in range(g.num_layers):
        # Filled in place by the load; DynamicLayer.update reads them after _wait.
        layers[i].lazy_initialization(ks[i], vs[i])
        layers[i].keys, layers[i].values = ks[i], vs[i]
    if overlap:
        return Fetched(cache, prefix, keys, [], hits, plan, hits)
    tiers = cache.finish()
    if None not in tiers:
        return Fetched(cache, prefix, keys, tiers, hits, plan, hits)
    good = tiers.index(None)
    for layer in kv_layers(cache):
        layer.keys = layer.keys[:, :, :good * reuse.chunk_tokens]
        layer.values = layer.values[:, :, :good * reuse.chunk_tokens]
    return Fetched(cache, good * reuse.chunk_tokens, keys, tiers[:good], hits, plan, good)


def store_chunks(reuse: PrefixReuse, keys, cache, first: int, held: int,
                 durable: bool) -> int:
    """Stores chunks [first, held) of sequence 0 of a DynamicCache straight from
    the GPU (gather + encode into kvtierd's pool)."""
    layers = kv_layers(cache)
    paged = kvtorch.PagedCache.from_contiguous([layer.keys for layer in layers],
                                               [layer.values for layer in layers],
                                               block_size=reuse.block_size)
    for i in range(first, held):
        kvtorch.store(reuse.client, keys[i], paged, _span(i, reuse.chunk_tokens, reuse.block_size),
                      codec=reuse.codec, fingerprint=reuse._fingerprint,
                      num_tokens=reuse.chunk_tokens, durable=durable)
    return held - first


def paged_descriptor(cache):
    """The kvtier.torch.PagedCache of a kvtier.hf_paged.PagedKvCache (built once)."""
    if cache._kernel_cache is None:
        layers = cache.layers
        cache._kernel_cache = kvtorch.PagedCache.from_separate(
            [layer.keys for layer in layers], [layer.values for layer in layers], "nhd",
            v_scales=[layer.v_scales for layer in layers] if cache.fp8_v else None)
    return cache._kernel_cache


def decode_attention(cache, layer_idx: int, q: torch.Tensor, total: int, scale: float):
    """kvtier's paged decode attention of one layer: q [batch, q_heads, head_dim]
    over `total` tokens of every sequence. Returns [batch, q_heads, head_dim]."""
    seq_lens = cache._seq_lens_cache.get(total) if hasattr(cache, "_seq_lens_cache") else None
    if seq_lens is None:
        cache._seq_lens_cache = {total: torch.full((cache.batch,), total, dtype=torch.int32,
                                                   device=q.device)}
        seq_lens = cache._seq_lens_cache[total]
    return kvtorch.decode_attention(q.contiguous(), paged_descriptor(cache), cache.block_table,
                                    seq_lens, layer_idx, sm_scale=scale)

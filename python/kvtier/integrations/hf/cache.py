"""The caches a fetch of kvtier.hf returns, shared by its CPU and GPU halves
(prefix.py, _gpu.py) and by way (b) (paged.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, cast

import torch
from transformers.cache_utils import Cache, DynamicCache

import kvtier


@dataclasses.dataclass
class Fetched:
    """A cache holding the fetched prefix of a prompt.

    cache: the model cache to pass as past_key_values (its sequence length is
      ``tokens``; on the GPU path its layers may still be arriving, which the
      cache itself waits for).
    tokens: prompt tokens whose KV the cache holds (a multiple of chunk_tokens).
    keys: the prompt's full-chunk keys.
    tiers: the tier each loaded chunk came from.
    hits: leading chunks that kvtierd holds (some may not have been loaded:
      the plan declined them, the last token must run, or a chunk was corrupt).
    plan: kvtierd's load plan.
    """
    cache: Cache
    tokens: int
    keys: list
    tiers: list
    hits: int
    plan: kvtier.LoadPlan | None
    #: Leading chunks kvtierd still holds as far as this fetch knows (hits,
    #: or the loaded ones when a chunk turned out missing or corrupt: kvtierd
    #: drops a corrupt chunk). The store after the prefill starts there.
    cached: int = 0


class KvLayer(Protocol):
    """What kvtier.hf uses of one layer of a model's cache."""
    keys: torch.Tensor    # [batch, kv_heads, seq, head_dim]
    values: torch.Tensor

    def lazy_initialization(self, key_states: torch.Tensor,
                            value_states: torch.Tensor) -> None: ...


def kv_layers(cache: Cache) -> list[KvLayer]:
    """The layers of a filled cache of a full-attention model (kv_geometry
    takes no other): transformers types a cache's layers more broadly
    (linear-attention and placeholder layers, K and V not yet allocated)."""
    return cast("list[KvLayer]", cache.layers)


class LayerwiseDynamicCache(DynamicCache):
    """A DynamicCache whose first layers' prefix is still being loaded.

    ``wait_layer(l)`` is called before layer l's cache is first read or
    extended; it makes the current stream wait for that layer's load. After
    every layer has been waited for, it behaves as a plain DynamicCache.
    """

    def __init__(self, config, wait_layer: Callable[[int], None], num_layers: int):
        super().__init__(config=config)
        self._wait_layer = wait_layer
        self._pending = set(range(num_layers))

    def _ready(self, layer_idx: int) -> None:
        if layer_idx in self._pending:
            self._wait_layer(layer_idx)
            self._pending.discard(layer_idx)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._ready(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def wait_all(self) -> None:
        """Waits (on the current stream) for every layer still loading."""
        for layer_idx in sorted(self._pending):
            self._ready(layer_idx)


__all__ = ["Fetched", "LayerwiseDynamicCache", "KvLayer", "kv_layers"]

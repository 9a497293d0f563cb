"""Way (b) of kvtier.hf: the fetched prefix stays as fetched (K16/V8) in a paged
cache, and decode steps run kvtier's paged attention over those blocks.

    import kvtier.hf_paged as hp
    model.set_attn_implementation(hp.ATTENTION)      # once; plain caches still use SDPA
    reuse = hp.PagedPrefixReuse(model, client, codec="k16v8")
    result = reuse.prefill(input_ids)                # result.past_key_values: PagedKvCache
    next_logits = model(input_ids=next_token, past_key_values=result.past_key_values).logits

The cache (``PagedKvCache``) holds, per layer, K [num_blocks, block_size,
kv_heads, head_dim] in the model's 16-bit dtype and V in FP8 e4m3 of the same
shape with one float32 scale per (block, kv head) [num_blocks, kv_heads]
(codec k16v8), or V in 16 bits (codec k16v16). These are the bytes of the
chunk's K and V sections, copied as they are: a chunk of ``chunk_tokens``
tokens fills ``chunk_tokens / block_size`` whole blocks and the chunk's
per-(block, head) V scales are the cache's. A token appended later (the
prompt's rest, decode steps) is written into its sequence's last block; with
FP8 V that block is quantized again with the scale of its new amax, exactly
as the codec quantizes a block.

Attention (``ATTENTION``, registered in transformers' AttentionInterface and
AttentionMaskInterface): with a PagedKvCache, one query token per sequence
runs ``kvtier.torch.decode_attention`` on a CUDA device (the kernel reads the
blocks, dequantizing V in registers), and anything else (the prompt's rest,
CPU) runs SDPA over the blocks gathered and dequantized (the reference
path). Without a PagedKvCache it is transformers' SDPA attention.

Limits: the sequences of one cache have equal lengths (no padding); one
model forward at a time per thread.
"""
from __future__ import annotations

import contextvars
import dataclasses
import struct
import warnings
from collections.abc import Sequence
from typing import cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import kvtier
import kvtier.torch as kvtorch
from kvtier.integrations.engine import UNUSABLE
from kvtier.integrations.hf import _gpu
from kvtier.integrations.hf.cache import Fetched
from kvtier.integrations.hf.prefix import PrefixReuse, kv_geometry
from kvtier.torch import TORCH_DTYPES

#: Name of the attention implementation (model.set_attn_implementation(ATTENTION)).
ATTENTION = "kvtier_paged"

FP8_MAX = 448.0  # e4m3 ("e4m3fn") largest finite value

# (cache, layer) of the attention about to run, set by PagedKvCache.update and
# taken by the attention function: a model's attention module updates its
# cache and calls the attention function right after, on the same thread.
_PENDING: contextvars.ContextVar = contextvars.ContextVar("kvtier_paged_pending", default=None)


# ---- chunk bytes (codec/FORMAT.md) ---------------------------------------------

_HEADER = 128
_FORMAT_BITS = {1: 16, 2: 16, 3: 8}  # FP16, BF16, FP8E4M3 (the formats this cache holds)


def _align16(n: int) -> int:
    return (n + 15) & ~15


@dataclasses.dataclass(frozen=True)
class ChunkSections:
    """Where one chunk's layer records lie (codec/FORMAT.md, "Sections"; in
    version 2 a record checksum table follows each section's records)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    block_size: int
    dtype: torch.dtype
    k_format: int
    v_format: int
    k_data: int       # bytes of a layer's K elements
    k_stride: int     # bytes between K layer records
    v_data: int
    v_scales: int     # scales per V layer record (0 for 16-bit V)
    v_stride: int
    v_offset: int     # V section's offset in the chunk


def chunk_sections(chunk) -> ChunkSections:
    """Verifies the chunk (kvtier.codec.inspect_chunk: header and checksums)
    and returns the layout of its sections. InvalidArgument for formats this
    cache cannot hold as they are (K must be 16-bit, V 16-bit or FP8 per
    (block, head))."""
    info = kvtier.codec.inspect_chunk(chunk)
    head = bytes(memoryview(chunk)[:_HEADER])
    k_format, v_format, _k_gran, v_gran = head[45], head[46], head[47], head[48]
    k_bytes, v_bytes = struct.unpack_from("<QQ", head, 56)
    if _FORMAT_BITS.get(k_format) != 16 or v_format not in _FORMAT_BITS or \
            (v_format == 3 and v_gran != 2):
        raise kvtier.InvalidArgument(3, f"a paged K16 cache cannot hold codec {info.codec}")
    elements = info.num_tokens * info.num_kv_heads * info.head_dim
    k_data = _align16(elements * 2)
    v_data = _align16(elements * _FORMAT_BITS[v_format] // 8)
    v_scales = 0
    if v_format == 3:
        v_scales = -(-info.num_tokens // info.block_size) * info.num_kv_heads
    sections = ChunkSections(
        info.num_layers, info.num_kv_heads, info.head_dim, info.num_tokens, info.block_size,
        TORCH_DTYPES[info.dtype], k_format, v_format,
        k_data, k_data, v_data, v_scales, v_data + _align16(4 * v_scales), _HEADER + k_bytes)
    # Version 2 ends each section with its record checksum table.
    version = struct.unpack_from("<H", head, 4)[0]
    table = _align16(8 * info.num_layers) if version >= 2 else 0
    assert sections.k_stride * info.num_layers + table == k_bytes
    assert sections.v_stride * info.num_layers + table == v_bytes
    return sections


# ---- the cache ---------------------------------------------------------------

class PagedLayer(CacheLayerMixin):
    """One layer of a PagedKvCache: its K, V and V-scale block tensors."""

    is_sliding = False
    is_compileable = False
    keys: torch.Tensor
    values: torch.Tensor
    v_scales: torch.Tensor | None  # float32 [num_blocks, kv_heads] of FP8 V; None for 16-bit V

    def __init__(self, owner: PagedKvCache, index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        o = owner
        shape = (o.num_blocks, o.block_size, o.num_kv_heads, o.head_dim)
        self.keys = torch.zeros(shape, dtype=o.dtype, device=o.device)
        self.values = torch.zeros(shape, dtype=o.v_dtype, device=o.device)
        self.v_scales = (torch.ones((o.num_blocks, o.num_kv_heads), dtype=torch.float32,
                                    device=o.device) if o.fp8_v else None)
        self.dtype, self.device = o.dtype, o.device
        self.is_initialized = True
        self.length = 0  # tokens of each sequence this layer holds

    def scales(self) -> torch.Tensor:
        """The V scales. REQUIRES: FP8 V (codec k16v8)."""
        if self.v_scales is None:
            raise ValueError("a 16-bit V cache has no V scales")
        return self.v_scales

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner._append(self, key_states, value_states)
        _PENDING.set((self.owner, self.index))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.max_blocks_per_seq * self.owner.block_size

    def reset(self) -> None:
        raise NotImplementedError("PagedKvCache cannot be reset")


class PagedKvCache(Cache):
    """A paged K16/V8 (or K16/V16) cache of `batch` sequences of equal length.

    num_layers, num_kv_heads, head_dim, dtype (bf16/fp16): the model's KV.
    max_tokens: tokens each sequence may hold (rounded up to whole blocks).
    codec: "k16v8" (V in FP8 e4m3 with per-(block, head) scales) or "k16v16".
    Sequence b owns blocks block_table[b] (int32 [batch, max_blocks_per_seq],
    on the cache's device; blocks b*max_blocks_per_seq + i). seq_len: tokens
    each sequence holds.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 batch: int, max_tokens: int, device, codec: str = "k16v8", block_size: int = 16):
        if codec not in ("k16v8", "k16v16"):
            raise ValueError(f"a paged cache holds k16v8 or k16v16, not {codec}")
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.codec, self.block_size, self.batch = codec, block_size, batch
        self.fp8_v = codec == "k16v8"
        self.v_dtype = torch.float8_e4m3fn if self.fp8_v else dtype
        self.max_blocks_per_seq = -(-max_tokens // block_size)
        self.num_blocks = batch * self.max_blocks_per_seq
        self.block_table = torch.arange(self.num_blocks, dtype=torch.int32).view(
            batch, self.max_blocks_per_seq).to(self.device)
        self._host_table = self.block_table.cpu()
        super().__init__(layers=[PagedLayer(self, i) for i in range(num_layers)])
        self._kernel_cache = None

    @classmethod
    def for_model(cls, model, *, batch: int, max_tokens: int, codec: str = "k16v8",
                  block_size: int = 16) -> PagedKvCache:
        g = kv_geometry(model)
        return cls(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                   dtype=g.dtype, batch=batch, max_tokens=max_tokens,
                   device=next(model.parameters()).device, codec=codec, block_size=block_size)

    @property
    def paged_layers(self) -> list[PagedLayer]:
        """The layers, as the PagedLayers they are (Cache types a cache's layers
        more broadly)."""
        return cast("list[PagedLayer]", self.layers)

    @property
    def seq_len(self) -> int:
        """Tokens each sequence holds (layer 0's count: during a forward, the
        layers already run hold the step's tokens too)."""
        return self.paged_layers[0].length

    # ---- writing -------------------------------------------------------------

    def _append(self, layer: PagedLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends K and V [batch, kv_heads, n, head_dim] of one layer at
        positions [length, length + n) of every sequence."""
        b, h, n, d = k.shape
        if b != self.batch:
            raise ValueError(f"cache holds {self.batch} sequences, got a batch of {b}")
        start = layer.length
        if start + n > self.max_blocks_per_seq * self.block_size:
            raise ValueError(f"{start + n} tokens exceed the cache's "
                             f"{self.max_blocks_per_seq * self.block_size}")
        pos = torch.arange(start, start + n, device=self.device)
        blocks = self.block_table[:, pos // self.block_size]          # [B, n]
        slots = (pos % self.block_size).expand(b, n)                   # [B, n]
        layer.keys[blocks, slots] = k.transpose(1, 2).to(self.dtype)
        if not self.fp8_v:
            layer.values[blocks, slots] = v.transpose(1, 2).to(self.dtype)
        else:
            first, last = start // self.block_size, (start + n - 1) // self.block_size
            touched = self.block_table[:, first:last + 1]                # [B, nb]
            dense = self._dequant_blocks(layer, touched)                 # [B, nb, bs, H, D] fp32
            flat = dense.view(b, -1, h, d)
            flat[:, start - first * self.block_size:start - first * self.block_size + n] = \
                v.transpose(1, 2).float()
            codes, scales = quantize_blocks(dense)
            _raw(layer.values)[touched] = _raw(codes)
            layer.scales()[touched] = scales
        layer.length = start + n

    def _dequant_blocks(self, layer: PagedLayer, blocks: torch.Tensor) -> torch.Tensor:
        """V of `blocks` ([...] block ids) as float32 [..., block_size, heads, dim]."""
        codes = _raw(layer.values)[blocks].view(layer.values.dtype).float()
        if not self.fp8_v:
            return codes
        return codes * layer.scales()[blocks][..., None, :, None]

    def load_chunk(self, chunk, position: int, sequences: Sequence[int] | None = None) -> None:
        """Copies a fetched chunk's K and V sections as they are into tokens
        [position, position + chunk tokens) of `sequences` (default: all).

        The chunk's geometry must be the cache's, its block size the cache's,
        and position a multiple of the block size. Does not advance seq_len
        (set_prefix does). InvalidArgument / DataLoss for bad bytes.
        """
        s = chunk_sections(chunk)
        if (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) != \
                (len(self.layers), self.num_kv_heads, self.head_dim, self.dtype):
            raise kvtier.InvalidArgument(3, "chunk geometry differs from the cache's")
        if s.block_size != self.block_size or position % self.block_size or \
                s.num_tokens % self.block_size or (s.v_format == 3) != self.fp8_v:
            raise kvtier.InvalidArgument(3, "chunk blocks or V format differ from the cache's")
        seqs = list(range(self.batch)) if sequences is None else list(sequences)
        nb = s.num_tokens // self.block_size
        first = position // self.block_size
        blocks = self._host_table[seqs, first:first + nb].reshape(-1).to(self.device)
        with warnings.catch_warnings():  # the fetched bytes are read-only: only copied from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(chunk, dtype=torch.uint8)
        elements = s.num_tokens * s.num_kv_heads * s.head_dim
        block_shape = (nb, self.block_size, s.num_kv_heads, s.head_dim)
        for li, layer in enumerate(self.paged_layers):
            k_at = _HEADER + li * s.k_stride
            k = raw[k_at:k_at + 2 * elements].view(self.dtype).view(block_shape)
            v_at = s.v_offset + li * s.v_stride
            v_elem = 1 if self.fp8_v else 2
            v = raw[v_at:v_at + v_elem * elements].view(self.v_dtype).view(block_shape)
            k, v = k.to(self.device), v.to(self.device)
            layer.keys[blocks] = k.repeat(len(seqs), 1, 1, 1)
            _raw(layer.values)[blocks] = _raw(v).repeat(len(seqs), 1, 1, 1)
            if self.fp8_v:
                sc_at = v_at + s.v_data
                sc = raw[sc_at:sc_at + 4 * s.v_scales].view(torch.float32).view(
                    nb, s.num_kv_heads).to(self.device)
                layer.scales()[blocks] = sc.repeat(len(seqs), 1)

    def set_prefix(self, tokens: int) -> None:
        """Declares that every sequence holds `tokens` tokens (after load_chunk)."""
        for layer in self.paged_layers:
            layer.length = tokens

    # ---- reading -------------------------------------------------------------

    def gather(self, layer_idx: int, tokens: int | None = None):
        """Dense K and V [batch, kv_heads, tokens, head_dim] in the model dtype
        (V dequantized as the codec decodes it), of the first `tokens`
        (default: all the layer holds) tokens."""
        layer = self.paged_layers[layer_idx]
        n = tokens if tokens is not None else layer.length
        nb = -(-n // self.block_size)
        blocks = self.block_table[:, :nb]
        k = layer.keys[blocks].flatten(1, 2)[:, :n]
        if self.fp8_v:
            v = self._dequant_blocks(layer, blocks).to(self.dtype).flatten(1, 2)[:, :n]
        else:
            v = layer.values[blocks].flatten(1, 2)[:, :n]
        return k.transpose(1, 2), v.transpose(1, 2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as uint8 views for indexing (index and index_put cover every
    dtype through bytes; not every build covers float8)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def quantize_blocks(x: torch.Tensor):
    """FP8 e4m3 codes and per-(block, head) scales of float32 blocks
    [..., block_size, heads, dim], by the codec's rule (codec/FORMAT.md):
    scale = amax / 448 (1 for an all-zero group), code = e4m3(x / scale)."""
    finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    amax = finite.amax(dim=(-3, -1))                                     # [..., heads]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[..., None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


# ---- attention -----------------------------------------------------------------

def paged_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """transformers attention function (AttentionInterface) for PagedKvCache.

    query: [batch, q_heads, q_len, head_dim]. Returns ([batch, q_len, q_heads,
    head_dim], None). Without a pending PagedKvCache it is SDPA.
    """
    pending = _PENDING.get()
    if pending is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    _PENDING.set(None)
    cache, layer_idx = pending
    b, hq, q_len, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    total = cache.paged_layers[layer_idx].length  # this step's tokens included
    if q_len == 1 and query.is_cuda and kernel_available():
        out = _decode_kernel(cache, layer_idx, query[:, :, 0], total, scale)
        return out.unsqueeze(1), None
    k, v = cache.gather(layer_idx, total)
    past = total - q_len
    q_pos = torch.arange(past, total, device=query.device)
    mask = torch.arange(total, device=query.device)[None, :] <= q_pos[:, None]   # [q, kv]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
    return out.transpose(1, 2).contiguous(), None


def kernel_available() -> bool:
    """True if libkvtier has the GPU path: one-token steps of a PagedKvCache on a
    CUDA device then run kvtier's decode attention kernel."""
    return kvtier.has_cuda()


def _decode_kernel(cache: PagedKvCache, layer_idx: int, q: torch.Tensor, total: int,
                   scale: float) -> torch.Tensor:
    return _gpu.decode_attention(cache, layer_idx, q, total, scale)


AttentionInterface.register(ATTENTION, paged_attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


# ---- prefix reuse --------------------------------------------------------------

class PagedPrefixReuse(PrefixReuse):
    """PrefixReuse whose fetched prefix stays K16/V8 in a PagedKvCache (way (b)).

    The model must use ATTENTION (model.set_attn_implementation(ATTENTION)).
    max_new_tokens: room each sequence keeps past the prompt for decoding.
    batch: sequences of the cache; each holds the same prompt (a batch of
    equal prompts, as the decode benchmark runs).
    Arguments otherwise as PrefixReuse; codec "k16v8" or "k16v16".
    """

    def __init__(self, model, client, *, max_new_tokens: int = 256, batch: int = 1, **kwargs):
        super().__init__(model, client, **kwargs)
        if model.config._attn_implementation != ATTENTION:
            raise ValueError(f"the model must use attention '{ATTENTION}' "
                             f"(model.set_attn_implementation('{ATTENTION}'))")
        self.max_new_tokens = max_new_tokens
        self.batch = batch

    def fetch(self, input_ids, max_chunks: int | None = None, *,
              overlap: bool = False) -> Fetched:
        """As PrefixReuse.fetch, into a PagedKvCache (the chunk bytes copied as
        they are; ``overlap`` has no effect)."""
        tokens = self._token_list(input_ids)
        keys = self.keys(tokens)
        chunks, hits, plan = self.plan(keys, len(tokens))
        if max_chunks is not None:
            chunks = min(chunks, max_chunks)
        cache = PagedKvCache.for_model(self.model, batch=self.batch,
                                       max_tokens=len(tokens) + self.max_new_tokens,
                                       codec=self.codec, block_size=self.block_size)
        if cache.device.type == "cuda" and kvtier.has_cuda():
            tiers = self._load_gpu(cache, keys[:chunks])
        else:
            tiers = []
            for i, key in enumerate(keys[:chunks]):
                try:
                    with self.client.get(key) as chunk:
                        cache.load_chunk(chunk.data, i * self.chunk_tokens)
                        tiers.append(chunk.tier)
                except UNUSABLE:
                    break
        loaded = len(tiers)
        cache.set_prefix(loaded * self.chunk_tokens)
        cached = hits if loaded == chunks else loaded
        return Fetched(cache, loaded * self.chunk_tokens, keys, tiers, hits, plan, cached)

    def _load_gpu(self, cache: PagedKvCache, keys) -> list:
        """Loads chunks into sequence 0's blocks with kvtier.torch.load (the K and V
        sections land as they are: FP8 codes and scales copied, not requantized),
        then copies those blocks to the other sequences. Returns the tiers of the
        leading chunks that loaded."""
        desc = _gpu.paged_descriptor(cache)
        per = self.chunk_tokens // cache.block_size
        tiers = []
        for i, key in enumerate(keys):
            try:
                tiers.append(kvtorch.load(self.client, key, desc,
                                          cache._host_table[0, i * per:(i + 1) * per].tolist()))
            except UNUSABLE:
                break
        nb = len(tiers) * per
        if nb and cache.batch > 1:
            src, dst = cache.block_table[0, :nb], cache.block_table[1:, :nb]
            for layer in cache.paged_layers:
                layer.keys[dst] = layer.keys[src].unsqueeze(0).expand(cache.batch - 1,
                                                                      *layer.keys[src].shape)
                values = _raw(layer.values)
                values[dst] = values[src].unsqueeze(0).expand(cache.batch - 1,
                                                              *values[src].shape)
                if cache.fp8_v:
                    scales = layer.scales()
                    scales[dst] = scales[src].unsqueeze(0).expand(cache.batch - 1,
                                                                  *scales[src].shape)
        return tiers

    def _run(self, run_ids, cache, last_logits_only, output_hidden_state, forward_kwargs):
        if isinstance(cache, PagedKvCache) and run_ids.shape[0] != cache.batch:
            run_ids = run_ids.expand(cache.batch, -1)
        return super()._run(run_ids, cache, last_logits_only, output_hidden_state, forward_kwargs)

    def store(self, input_ids, cache, *, first_chunk: int = 0, durable: bool = False) -> int:
        if not isinstance(cache, PagedKvCache):
            return super().store(input_ids, cache, first_chunk=first_chunk, durable=durable)
        keys = self.keys(input_ids)
        held = min(len(keys), cache.seq_len // self.chunk_tokens)
        spec = self.chunk_spec()
        for i in range(first_chunk, held):
            k, v = _chunk_from_paged(cache, i, self.chunk_tokens)
            self.client.put(keys[i], kvtorch.encode_chunk(spec, k.cpu(), v.cpu()), durable=durable)
        return max(0, held - first_chunk)


def _chunk_from_paged(cache: PagedKvCache, chunk: int, chunk_tokens: int):
    """K and V [layers, tokens, heads, dim] (16-bit) of sequence 0's chunk."""
    begin = chunk * chunk_tokens
    ks, vs = [], []
    for li in range(len(cache.layers)):
        k, v = cache.gather(li, begin + chunk_tokens)
        ks.append(k[0, :, begin:].transpose(0, 1))
        vs.append(v[0, :, begin:].transpose(0, 1))
    return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()


__all__ = ["ATTENTION", "PagedKvCache", "PagedPrefixReuse", "paged_attention_forward",
           "kernel_available", "quantize_blocks", "chunk_sections", "ChunkSections"]

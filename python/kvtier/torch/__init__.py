"""kvtier for PyTorch: the CPU codec over tensors, and (in a build with CUDA)
the GPU paged-cache path and the paged decode attention kernel
(kvtier/torch/_gpu.py), re-exported here.

Tensors are passed by data_ptr(); nothing is copied to numpy on the way.
"""
from __future__ import annotations

import torch

from kvtier import codec as _codec
from kvtier.codec import ChunkInfo, ChunkSpec

# The GPU path: its calls raise ImportError when libkvtier was built without CUDA.
from kvtier.torch._gpu import (
    LayerwiseLoad,
    PagedCache,
    PendingStore,
    begin_store,
    close_gpu,
    decode_attention,
    load,
    load_layerwise,
    open_gpu,
    store,
    store_batch,
)

#: The chunk dtype name of each 16-bit torch dtype that chunks hold, and back.
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor for the CPU codec (got {t.device}); "
                             "use kvtier.torch.store/load for GPU caches")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name} must be bfloat16 or float16, not {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [layers, tokens, kv_heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v differ: {tuple(k.shape)} {k.dtype} vs {tuple(v.shape)} "
                         f"{v.dtype}")


def spec_for(fingerprint, k: torch.Tensor, codec: str = "k16v8", block_size: int = 16) -> ChunkSpec:
    """The ChunkSpec of a chunk holding `k`'s shape [layers, tokens, heads, dim]."""
    layers, tokens, heads, dim = k.shape
    return ChunkSpec(fingerprint, layers, heads, dim, tokens, block_size, DTYPE_NAMES[k.dtype],
                     codec)


def encode_chunk(spec_or_fingerprint, k: torch.Tensor, v: torch.Tensor, codec: str = "k16v8",
                 block_size: int = 16) -> bytearray:
    """Encodes CPU tensors K and V [layers, tokens, kv_heads, head_dim] (bf16 or
    fp16) into a sealed chunk. The first argument is a ChunkSpec (its shape
    must match) or a model fingerprint (with `codec` and `block_size`)."""
    _check_kv(k, v)
    if isinstance(spec_or_fingerprint, ChunkSpec):
        spec = spec_or_fingerprint
        want = spec_for(spec.fingerprint, k, spec.codec, spec.block_size)
        if want != spec:
            raise ValueError(f"tensors of shape {tuple(k.shape)} {k.dtype} do not match {spec}")
    else:
        spec = spec_for(spec_or_fingerprint, k, codec, block_size)
    k = k.contiguous()
    v = v.contiguous()
    return _codec.encode_chunk_into(spec, k.data_ptr(), v.data_ptr())


def decode_chunk(chunk, layers: tuple[int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifies and decodes a chunk into CPU tensors K and V [layers, tokens,
    kv_heads, head_dim] of the chunk's dtype; `layers` = (begin, end) decodes
    only those layers. InvalidArgument / DataLoss for bad bytes."""
    info = _codec.read_header(chunk)  # sizes the tensors; the decode verifies
    begin, end = (0, info.num_layers) if layers is None else layers
    if not 0 <= begin < end <= info.num_layers:
        raise ValueError(f"layer range [{begin}, {end}) is not within the chunk's "
                         f"{info.num_layers} layers")
    shape = (end - begin, info.num_tokens, info.num_kv_heads, info.head_dim)
    dtype = TORCH_DTYPES[info.dtype]
    k = torch.empty(shape, dtype=dtype)
    v = torch.empty(shape, dtype=dtype)
    _codec.decode_chunk_into(chunk, k.data_ptr(), v.data_ptr(), (begin, end))
    return k, v


def inspect_chunk(chunk) -> ChunkInfo:
    return _codec.inspect_chunk(chunk)


__all__ = ["encode_chunk", "decode_chunk", "inspect_chunk", "spec_for", "DTYPE_NAMES",
           "TORCH_DTYPES", "PagedCache", "PendingStore", "LayerwiseLoad", "store", "store_batch",
           "begin_store", "load", "load_layerwise", "decode_attention", "open_gpu", "close_gpu"]

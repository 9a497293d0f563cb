"""kvtier: a tiered KV-cache store for LLM inference engines.

    import kvtier
    c = kvtier.Client(socket="./kvtier-data/kvtierd.sock")
    keys = kvtier.prefix_keys("meta-llama/Llama-3.1-8B", token_ids)
    cached = c.lookup(keys)                 # tiers of the cached prefix
    with c.get(keys[0]) as chunk:           # zero-copy, verified
        info, k, v = kvtier.codec.decode_chunk(chunk.data)

The core needs no torch; kvtier.torch (tensors, GPU paged caches, attention)
and kvtier.hf (Hugging Face transformers prefix reuse) import it.
"""
from kvtier import codec
from kvtier._version import __version__ as __version__
from kvtier.client import Chunk, Client, HostPage, LoadPlan, PagesResult
from kvtier.codec import ChunkInfo, ChunkSpec
from kvtier.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvtier.keys import ModelIdentity, as_key, chunk_keys, key_hex, prefix_keys


def library_version() -> str:
    """Version of the loaded libkvtier.so."""
    from kvtier import _native
    return _native.load().kvtier_version().decode()


def has_cuda() -> bool:
    """True if the loaded libkvtier.so has the GPU path."""
    from kvtier import _native
    return bool(_native.load().kvtier_has_cuda())


__all__ = [
    "Client", "Chunk", "HostPage", "PagesResult", "LoadPlan", "ChunkSpec", "ChunkInfo",
    "ModelIdentity", "codec",
    "prefix_keys", "chunk_keys", "key_hex", "as_key", "library_version", "has_cuda",
    "KvtierError", "InvalidArgument", "NotFound", "AlreadyExists", "PermissionDenied",
    "ResourceExhausted", "FailedPrecondition", "DeadlineExceeded", "Unavailable", "DataLoss",
    "Unauthenticated",
]

"""Chunk keys: the chain of XXH3-128 hashes over token ids rooted in a model
fingerprint (DESIGN.md "Keys"), computed by libkvtier so that every binding
and the `kvtier keys` command give the same bytes."""
from __future__ import annotations

import array
import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier import _native

Key = bytes | bytearray | memoryview | str


def as_key(key: Key) -> bytes:
    """16 key bytes from 16 bytes or 32 hex digits. InvalidArgument otherwise."""
    from kvtier.errors import InvalidArgument
    if isinstance(key, str):
        if len(key) != 32:
            raise InvalidArgument(3, f"key {key!r} is not 32 hex digits")
        try:
            return bytes.fromhex(key)
        except ValueError:
            raise InvalidArgument(3, f"key {key!r} is not 32 hex digits") from None
    if isinstance(key, (bytes, bytearray, memoryview)):
        b = bytes(key)
        if len(b) != 16:
            raise InvalidArgument(3, f"a key is 16 bytes, got {len(b)}")
        return b
    raise TypeError(f"a key is 16 bytes or 32 hex digits, not {type(key).__name__}")


def key_hex(key: Key) -> str:
    """The 32-hex-digit form of a key, as the CLI prints it."""
    return as_key(key).hex()


@dataclass(frozen=True)
class ModelIdentity:
    """What identifies the KV of one model shard; engines share chunks only
    when every field matches (codec::ModelIdentity). The defaults are those
    of `kvtier keys`."""
    model_id: str
    revision: str = ""
    dtype: str = "bf16"
    kv_layout: str = "nhd"
    codec: str = "k16v8"
    tp_world_size: int = 1
    tp_rank: int = 0

    def _c(self):
        lib = _native.load()
        c = _native.ModelIdentityC()
        lib.kvtier_model_identity_init(ctypes.byref(c))
        c.model_id = self.model_id.encode()
        c.revision = self.revision.encode()
        c.dtype = self.dtype.encode()
        c.kv_layout = self.kv_layout.encode()
        c.codec = self.codec.encode()
        _native.set_int(c, "tp_world_size", self.tp_world_size)
        _native.set_int(c, "tp_rank", self.tp_rank)
        return c

    def fingerprint(self) -> bytes:
        """XXH3-128 of the identity's canonical text (16 bytes)."""
        lib = _native.load()
        out = (ctypes.c_uint8 * 16)()
        _native.check(lib.kvtier_fingerprint(ctypes.byref(self._c()), out))
        return bytes(out)


def _token_array(token_ids: Iterable[int]):
    ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    try:
        return (ctypes.c_uint32 * max(1, len(ids)))(*ids), len(ids)
    except (TypeError, OverflowError) as e:
        from kvtier.errors import InvalidArgument
        raise InvalidArgument(3, f"token ids must be integers in [0, 2^32): {e}") from None


def chunk_keys(fingerprint: Key, token_ids: Sequence[int], chunk_tokens: int = 256,
               partial: bool = False) -> list[bytes]:
    """Keys of the full chunks of `token_ids` (and of a trailing partial
    chunk with `partial`) under `fingerprint`. An ``array.array`` of 4-byte
    unsigned ints (typecode "I") is passed to libkvtier as it is, with no
    per-token conversion (a 32K-token prompt: tens of microseconds against
    milliseconds for a list)."""
    lib = _native.load()
    fp = as_key(fingerprint)
    keep = None
    if isinstance(token_ids, array.array) and token_ids.typecode == "I" \
            and token_ids.itemsize == 4 and len(token_ids):
        keep = token_ids
        address, n = token_ids.buffer_info()
        tokens = ctypes.cast(address, ctypes.POINTER(ctypes.c_uint32))
    else:
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if any(t < 0 or t > 0xFFFFFFFF for t in token_ids):
            from kvtier.errors import InvalidArgument
            raise InvalidArgument(3, "token ids must be integers in [0, 2^32)")
        tokens, n = _token_array(token_ids)
    if chunk_tokens <= 0:
        from kvtier.errors import InvalidArgument
        raise InvalidArgument(3, "chunk_tokens must be positive")
    cap = n // chunk_tokens + 1
    out = (ctypes.c_uint8 * (16 * cap))()
    count = ctypes.c_size_t()
    _native.check(lib.kvtier_chunk_keys(_native.key_arg(fp), tokens, n, chunk_tokens,
                                        int(partial), out, ctypes.byref(count)))
    del keep
    raw = bytes(out)
    return [raw[16 * i:16 * i + 16] for i in range(count.value)]


def prefix_keys(model_id: str | ModelIdentity, token_ids: Sequence[int],
                chunk_tokens: int = 256, *, revision: str = "", dtype: str = "bf16",
                kv_layout: str = "nhd", codec: str = "k16v8",
                tp_world_size: int = 1, tp_rank: int = 0, partial: bool = False) -> list[bytes]:
    """Chunk keys of a prompt, byte-identical to `kvtier keys --model-id ...
    --tokens ... --chunk-tokens N` with the same arguments."""
    ident = model_id if isinstance(model_id, ModelIdentity) else ModelIdentity(
        model_id, revision, dtype, kv_layout, codec, tp_world_size, tp_rank)
    return chunk_keys(ident.fingerprint(), token_ids, chunk_tokens, partial)

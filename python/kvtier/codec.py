"""The chunk codec on the CPU (libkvtier's codec/, the reference the GPU
kernels match byte for byte), over plain buffers: no torch needed.

K and V are 16-bit elements (bits of `dtype`) laid out [layers][tokens]
[kv_heads][head_dim]. A chunk is the versioned, checksummed format of
codec/FORMAT.md; `codec` names its K/V format pair (k16v8: 16-bit keys, FP8
e4m3 values with per-(block, head) scales; k16v16: lossless; k8v8, k16v4,
k8v4, k16vi8, ki8vi8 or "k=FMT[/GRAN],v=FMT[/GRAN]").
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from kvtier import _native
from kvtier.errors import InvalidArgument
from kvtier.keys import Key, as_key


@dataclass(frozen=True)
class ChunkSpec:
    """Shape and format of one chunk. fingerprint: the model fingerprint
    (ModelIdentity.fingerprint()); block_size: the engine's block size, the
    granularity of per-(block, head) scales."""
    fingerprint: Key
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    block_size: int = 16
    dtype: str = "bf16"
    codec: str = "k16v8"

    @property
    def elements(self) -> int:
        """16-bit elements of K (and of V)."""
        return self.num_layers * self.num_tokens * self.num_kv_heads * self.head_dim

    def _c(self) -> _native.ChunkSpecC:
        c = _native.ChunkSpecC()
        c.struct_size = ctypes.sizeof(c)
        ctypes.memmove(c.fingerprint, as_key(self.fingerprint), 16)
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_tokens", "block_size"):
            value = int(getattr(self, name))
            if not 0 <= value < 2**32:
                raise InvalidArgument(3, f"{name} {value} is out of range")
            setattr(c, name, value)
        c.dtype = self.dtype.encode()
        c.codec = self.codec.encode()
        return c


@dataclass(frozen=True)
class ChunkInfo:
    """A verified chunk's header."""
    fingerprint: bytes
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    block_size: int
    dtype: str
    codec: str
    total_bytes: int

    @property
    def elements(self) -> int:
        return self.num_layers * self.num_tokens * self.num_kv_heads * self.head_dim


def chunk_bytes(spec: ChunkSpec) -> int:
    """Encoded size of a chunk of `spec`, header included."""
    out = ctypes.c_uint64()
    _native.check(_native.load().kvtier_chunk_bytes(ctypes.byref(spec._c()), ctypes.byref(out)))
    return out.value


def encode_chunk_into(spec: ChunkSpec, k_address: int, v_address: int, out=None) -> bytearray:
    """encode_chunk over raw addresses of spec.elements 16-bit elements each
    (for tensors: data_ptr()); the caller keeps that memory alive."""
    lib = _native.load()
    c = spec._c()
    size = ctypes.c_uint64()
    _native.check(lib.kvtier_chunk_bytes(ctypes.byref(c), ctypes.byref(size)))
    if out is None:
        out = bytearray(size.value)
    addr, n, keep = _native.buffer_address(out, writable=True)
    if n != size.value:
        raise InvalidArgument(3, f"output buffer holds {n} bytes; the chunk is {size.value}")
    _native.check(lib.kvtier_encode_chunk(ctypes.byref(c), k_address, v_address, addr, n))
    del keep
    return out


def encode_chunk(spec: ChunkSpec, k, v) -> bytearray:
    """Encodes K and V (buffers of spec.elements 16-bit elements each) into a
    sealed chunk."""
    want = spec.elements * 2
    ka, kn, kkeep = _native.buffer_address(k)
    va, vn, vkeep = _native.buffer_address(v)
    if kn != want or vn != want:
        raise InvalidArgument(3, f"K and V must hold {want} bytes each ({spec.elements} 16-bit "
                                 f"elements); got {kn} and {vn}")
    out = encode_chunk_into(spec, ka, va)
    del kkeep, vkeep
    return out


def _describe(fn, chunk) -> ChunkInfo:
    addr, n, keep = _native.buffer_address(chunk)
    info = _native.ChunkInfoC()
    info.struct_size = ctypes.sizeof(info)
    _native.check(fn(addr, n, ctypes.byref(info)))
    del keep
    return ChunkInfo(bytes(info.fingerprint), info.num_layers, info.num_kv_heads, info.head_dim,
                     info.num_tokens, info.block_size, info.dtype.decode(), info.codec.decode(),
                     info.total_bytes)


def inspect_chunk(chunk) -> ChunkInfo:
    """Verifies a chunk (header and both checksums) and describes it.
    InvalidArgument / DataLoss for bad bytes."""
    return _describe(_native.load().kvtier_chunk_inspect, chunk)


def read_header(chunk) -> ChunkInfo:
    """Describes a chunk from its header alone (header checksum and length
    checked, sections not): for sizing buffers before a decode, which
    verifies everything."""
    return _describe(_native.load().kvtier_chunk_header, chunk)


def decode_chunk_into(chunk, k_address: int, v_address: int,
                      layers: tuple[int, int] | None = None) -> ChunkInfo:
    """decode_chunk into raw addresses (for tensors: data_ptr()) of
    (layer_end - layer_begin) * tokens * heads * head_dim elements each.
    Verifies the chunk (header and both checksums) as it decodes."""
    info = read_header(chunk)
    begin, end = (0, info.num_layers) if layers is None else layers
    per_layer = info.num_tokens * info.num_kv_heads * info.head_dim
    addr, n, keep = _native.buffer_address(chunk)
    _native.check(_native.load().kvtier_decode_chunk_layers(
        addr, n, int(begin), int(end), k_address, v_address, per_layer * max(0, end - begin)))
    del keep
    return info


def decode_chunk(chunk, layers: tuple[int, int] | None = None
                 ) -> tuple[ChunkInfo, bytearray, bytearray]:
    """Verifies and decodes a chunk: (info, K, V), K and V as bytearrays of
    16-bit elements of info.dtype, [layers][tokens][kv_heads][head_dim].
    `layers` = (begin, end) decodes only those layers."""
    info = read_header(chunk)
    begin, end = (0, info.num_layers) if layers is None else layers
    if not 0 <= begin < end <= info.num_layers:
        raise InvalidArgument(3, f"layer range [{begin}, {end}) is not within the chunk's "
                                 f"{info.num_layers} layers")
    elements = info.num_tokens * info.num_kv_heads * info.head_dim * (end - begin)
    k = bytearray(2 * elements)
    v = bytearray(2 * elements)
    ka, _, kkeep = _native.buffer_address(k, writable=True)
    va, _, vkeep = _native.buffer_address(v, writable=True)
    decode_chunk_into(chunk, ka, va, (begin, end))
    del kkeep, vkeep
    return info, k, v

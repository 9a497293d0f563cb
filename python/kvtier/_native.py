"""Loads libkvtier.so (the C API of client/kvtier_c.h, and of
client/kvtier_c_gpu.h in a build with CUDA) with ctypes: the package's one
loader, signature tables and status check.

ctypes instead of a compiled extension: one build of libkvtier serves every
Python version (the CI machine's 3.11, the GPU machine's 3.12) with no
per-interpreter build step, and the C API is small and stable
(kvtier_abi_version). Every call releases the GIL while it runs.

Search order for the library: $KVTIER_LIBRARY, kvtier/_lib/libkvtier.so
inside the installed package, then the build folders of the source tree this
package sits in (build/, build-dev/, ...).
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from ctypes import (
    POINTER,
    c_char,
    c_char_p,
    c_double,
    c_float,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

ABI_VERSION = 1

_here = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    env = os.environ.get("KVTIER_LIBRARY")
    if env:
        yield env
        return
    yield os.path.join(_here, "_lib", "libkvtier.so")
    repo = os.path.dirname(os.path.dirname(_here))
    for pattern in ("build/client/libkvtier.so", "build*/client/libkvtier.so"):
        yield from sorted(glob.glob(os.path.join(repo, pattern)))


class ClientOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("socket_path", c_char_p),
        ("tcp_addr", c_char_p),
        ("token", c_char_p),
        ("token_file", c_char_p),
        ("timeout_ms", c_int64),
        ("shared_memory", c_int32),
        ("max_data_connections", c_int32),
        ("populate_mapping", c_int32),
        ("tls_ca", c_char_p),
        ("tls_cert", c_char_p),
        ("tls_key", c_char_p),
        ("tls_server_name", c_char_p),
    ]


class LoadPlanC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("hits", c_size_t),
        ("load_chunks", c_size_t),
        ("load_chunks_us", c_double),
        ("saved_us", c_double),
        ("tiers", POINTER(c_uint8)),
        ("chunk_bytes", POINTER(c_uint64)),
        ("load_us", POINTER(c_double)),
    ]


class ModelIdentityC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("model_id", c_char_p),
        ("revision", c_char_p),
        ("dtype", c_char_p),
        ("kv_layout", c_char_p),
        ("codec", c_char_p),
        ("tp_world_size", c_uint32),
        ("tp_rank", c_uint32),
    ]


class ChunkSpecC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("fingerprint", c_uint8 * 16),
        ("num_layers", c_uint32),
        ("num_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("num_tokens", c_uint32),
        ("block_size", c_uint32),
        ("dtype", c_char_p),
        ("codec", c_char_p),
    ]


class ChunkInfoC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("fingerprint", c_uint8 * 16),
        ("num_layers", c_uint32),
        ("num_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("num_tokens", c_uint32),
        ("block_size", c_uint32),
        ("dtype", c_char * 8),
        ("codec", c_char * 64),
        ("total_bytes", c_uint64),
    ]


class HostPageC(ctypes.Structure):
    """kvtier_host_page: where one page's K and V rows live (elements)."""
    _fields_ = [
        ("k", c_void_p),
        ("v", c_void_p),
        ("layer_stride", c_uint64),
        ("token_stride", c_uint64),
    ]


_KEY = POINTER(c_uint8)

_SIGNATURES = {
    "kvtier_abi_version": (c_int, []),
    "kvtier_version": (c_char_p, []),
    "kvtier_last_error": (c_char_p, []),
    "kvtier_free": (None, [c_void_p]),
    "kvtier_has_cuda": (c_int, []),
    "kvtier_client_options_init": (None, [POINTER(ClientOptions)]),
    "kvtier_client_open": (c_int, [POINTER(ClientOptions), POINTER(c_void_p)]),
    "kvtier_client_close": (None, [c_void_p]),
    "kvtier_client_uses_shared_memory": (c_int, [c_void_p]),
    "kvtier_put": (c_int, [c_void_p, _KEY, c_void_p, c_uint64, c_int]),
    "kvtier_get": (c_int, [c_void_p, _KEY, POINTER(c_void_p), POINTER(c_void_p),
                           POINTER(c_uint64), POINTER(c_int)]),
    "kvtier_release": (c_int, [c_void_p]),
    "kvtier_delete": (c_int, [c_void_p, _KEY]),
    "kvtier_lookup": (c_int, [c_void_p, _KEY, c_size_t, POINTER(c_uint8), POINTER(c_size_t)]),
    "kvtier_plan_load": (c_int, [c_void_p, _KEY, c_size_t, c_double, c_uint32,
                                 POINTER(LoadPlanC)]),
    "kvtier_plan_load_attention": (c_int, [c_void_p, _KEY, c_size_t, c_double, c_double,
                                           c_uint32, POINTER(LoadPlanC)]),
    "kvtier_prefetch": (c_int, [c_void_p, _KEY, c_size_t, c_uint32, POINTER(c_int)]),
    "kvtier_stats_json": (c_int, [c_void_p, POINTER(c_void_p)]),
    "kvtier_model_identity_init": (None, [POINTER(ModelIdentityC)]),
    "kvtier_fingerprint": (c_int, [POINTER(ModelIdentityC), _KEY]),
    "kvtier_chunk_keys": (c_int, [_KEY, POINTER(c_uint32), c_size_t, c_uint32, c_int, _KEY,
                                  POINTER(c_size_t)]),
    "kvtier_chunk_bytes": (c_int, [POINTER(ChunkSpecC), POINTER(c_uint64)]),
    "kvtier_encode_chunk": (c_int, [POINTER(ChunkSpecC), c_void_p, c_void_p, c_void_p,
                                    c_uint64]),
    "kvtier_chunk_inspect": (c_int, [c_void_p, c_uint64, POINTER(ChunkInfoC)]),
    "kvtier_chunk_header": (c_int, [c_void_p, c_uint64, POINTER(ChunkInfoC)]),
    "kvtier_decode_chunk": (c_int, [c_void_p, c_uint64, c_void_p, c_void_p, c_uint64]),
    "kvtier_decode_chunk_layers": (c_int, [c_void_p, c_uint64, c_uint32, c_uint32, c_void_p,
                                           c_void_p, c_uint64]),
    "kvtier_put_pages": (c_int, [c_void_p, POINTER(ChunkSpecC), _KEY, c_size_t,
                                 POINTER(HostPageC), c_uint32, POINTER(c_int),
                                 POINTER(c_uint64)]),
    "kvtier_get_pages": (c_int, [c_void_p, POINTER(ChunkSpecC), _KEY, c_size_t,
                                 POINTER(HostPageC), c_uint32, POINTER(c_int),
                                 POINTER(c_uint64)]),
}

class GpuCacheDesc(ctypes.Structure):
    """kvtier_gpu_cache_desc (client/kvtier_c_gpu.h): one paged KV cache on a GPU."""
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_layers", c_uint32),
        ("num_blocks", c_uint32),
        ("block_size", c_uint32),
        ("num_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("k_dtype", c_int32),
        ("v_dtype", c_int32),
        ("k_layers", POINTER(c_uint64)),
        ("v_layers", POINTER(c_uint64)),
        ("k_scale_layers", POINTER(c_uint64)),
        ("v_scale_layers", POINTER(c_uint64)),
        ("k_offset", c_int64),
        ("v_offset", c_int64),
        ("stride_block", c_int64),
        ("stride_token", c_int64),
        ("stride_head", c_int64),
        ("device", c_int32),
    ]


_I32S = POINTER(c_int32)
_U32S = POINTER(c_uint32)
_U64S = POINTER(c_uint64)
_INTS = POINTER(c_int)

# The GPU path (client/kvtier_c_gpu.h), present only in a build with CUDA.
_GPU_SIGNATURES = {
    "kvtier_gpu_cache_desc_init": (None, [POINTER(GpuCacheDesc)]),
    "kvtier_gpu_cache_create": (c_int, [POINTER(GpuCacheDesc), POINTER(c_void_p)]),
    "kvtier_gpu_cache_destroy": (None, [c_void_p]),
    "kvtier_gpu_open": (c_int, [c_void_p, c_int32, POINTER(c_void_p)]),
    "kvtier_gpu_close": (None, [c_void_p]),
    "kvtier_gpu_store": (c_int, [c_void_p, _KEY, _KEY, c_char_p, c_void_p, _I32S, c_uint32,
                                 c_uint32, c_uint32, c_uint64, c_int]),
    "kvtier_gpu_store_batch": (c_int, [c_void_p, _KEY, c_size_t, _KEY, c_char_p, c_void_p, _I32S,
                                       c_uint32, c_uint32, c_uint32, c_uint64, c_int, _INTS]),
    "kvtier_gpu_store_begin": (c_int, [c_void_p, _KEY, c_char_p, c_void_p, c_uint32,
                                       POINTER(c_void_p)]),
    "kvtier_gpu_store_layers": (c_int, [c_void_p, c_void_p, _I32S, c_uint32, c_uint32, c_uint32,
                                        c_uint32, c_uint64]),
    "kvtier_gpu_store_commit": (c_int, [c_void_p, _KEY, c_int]),
    "kvtier_gpu_store_commit_async": (c_int, [c_void_p, _KEY, c_int]),
    "kvtier_gpu_store_wait": (c_int, [c_void_p, c_int64]),
    "kvtier_gpu_store_release": (None, [c_void_p]),
    "kvtier_gpu_load": (c_int, [c_void_p, _KEY, c_void_p, _I32S, c_uint32, c_uint32, c_uint32,
                                c_uint32, c_uint64, _INTS]),
    "kvtier_gpu_load_layerwise": (c_int, [c_void_p, _KEY, c_size_t, c_void_p, _I32S, _U64S,
                                          _U32S, _U32S, c_uint32, c_uint64, POINTER(c_void_p)]),
    "kvtier_gpu_layerwise_wait_layer": (c_int, [c_void_p, c_uint32, c_uint64]),
    "kvtier_gpu_layerwise_finish": (c_int, [c_void_p, _INTS, _INTS]),
    "kvtier_gpu_layerwise_release": (None, [c_void_p]),
    "kvtier_attention_decode": (c_int, [c_void_p, c_uint64, c_int32, c_uint32, c_uint32,
                                        c_uint64, _I32S, c_uint32, c_uint64, _I32S, c_uint32,
                                        c_float, c_uint64, c_uint64]),
}

class Library(ctypes.CDLL):
    """libkvtier.so as loaded; ``path``: the file it was loaded from."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


_lock = threading.Lock()
_lib: Library | None = None
_gpu_bound = False


def load() -> Library:
    """The loaded library (loaded once). ImportError naming every place tried."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if not os.path.exists(path):
                tried.append(f"{path} (absent)")
                continue
            try:
                lib = Library(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            bind(lib, _SIGNATURES)
            abi = lib.kvtier_abi_version()
            if abi != ABI_VERSION:
                tried.append(f"{path} (ABI {abi}, this package needs {ABI_VERSION})")
                continue
            _lib = lib
            return lib
        raise ImportError("kvtier: libkvtier.so not found or unusable; set KVTIER_LIBRARY. Tried: "
                          + "; ".join(tried))


def load_gpu() -> Library:
    """The loaded library with its GPU functions bound too. ImportError if it
    cannot be loaded or was built without CUDA."""
    global _gpu_bound
    lib = load()
    with _lock:
        if not _gpu_bound:
            if not lib.kvtier_has_cuda():
                raise ImportError(f"libkvtier ({lib.path}) was built without CUDA")
            bind(lib, _GPU_SIGNATURES)
            _gpu_bound = True
    return lib


# The values each integer type of the C API holds; ctypes would silently
# wrap anything outside them (2**32 passed as a uint32_t is 0).
_INT_RANGES = {
    t: ((0, 2 ** (8 * ctypes.sizeof(t)) - 1) if t(-1).value > 0
        else (-(2 ** (8 * ctypes.sizeof(t) - 1)), 2 ** (8 * ctypes.sizeof(t) - 1) - 1))
    for t in (c_uint8, c_uint16, c_uint32, c_uint64, c_size_t, c_int, c_int32, c_int64)
}


def _out_of_range(what: str, value, ctype) -> Exception:
    from kvtier.errors import InvalidArgument
    lo, hi = _INT_RANGES[ctype]
    return InvalidArgument(3, f"{what}: {value} is out of range ({lo}..{hi})")


def bind(lib, signatures: dict) -> None:
    """Sets the result and argument types of each C function in
    `signatures` ({name: (restype, argtypes)}) and makes every integer
    argument checked: a Python int outside its C type's range raises
    InvalidArgument instead of being wrapped by ctypes."""
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
        checks = [(i, t) for i, t in enumerate(argtypes) if t in _INT_RANGES]
        if checks:
            setattr(lib, name, _checked(fn, name, checks))


def _checked(fn, name: str, checks):
    def call(*args):
        for i, t in checks:
            v = args[i]
            if isinstance(v, int):
                lo, hi = _INT_RANGES[t]
                if not lo <= v <= hi:
                    raise _out_of_range(f"{name} argument {i}", v, t)
        return fn(*args)
    call.__name__ = name
    return call


def set_int(struct, field: str, value) -> None:
    """Sets an integer field of a ctypes Structure, or raises InvalidArgument
    if `value` is outside the field's C type (ctypes would wrap it)."""
    t = dict(struct._fields_)[field]
    v = int(value)
    lo, hi = _INT_RANGES[t]
    if not lo <= v <= hi:
        raise _out_of_range(field, v, t)
    setattr(struct, field, v)


def last_error() -> str:
    msg = load().kvtier_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(rc: int) -> None:
    """Raises the exception for a non-zero status of the C API."""
    if rc != 0:
        from kvtier.errors import error_for
        raise error_for(rc, last_error())


def key_arg(key: bytes):
    """A ctypes pointer to the 16 bytes of `key` (bytes, already checked)."""
    return ctypes.cast(ctypes.c_char_p(key), _KEY)


def keys_arg(keys: list[bytes]):
    joined = b"".join(keys)
    buf = (c_uint8 * max(1, len(joined))).from_buffer_copy(joined or b"\0")
    return buf


def buffer_address(obj, writable: bool = False):
    """(address, nbytes, keepalive) of a C-contiguous buffer-protocol object.

    Writable buffers and bytes are passed in place; another read-only buffer
    is copied once (ctypes cannot take its address). Keep `keepalive` alive
    for as long as the address is used."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    n = mv.nbytes
    if n == 0:
        return None, 0, mv
    if isinstance(obj, bytes):
        if writable:
            raise ValueError("bytes are read-only")
        return ctypes.cast(ctypes.c_char_p(obj), c_void_p).value, n, obj
    if mv.readonly:
        if writable:
            raise ValueError("buffer is read-only")
        copy = (c_char * n).from_buffer_copy(mv.cast("B"))
        return ctypes.addressof(copy), n, copy
    flat = mv.cast("B")
    arr = (c_char * n).from_buffer(flat)
    return ctypes.addressof(arr), n, (arr, flat)


__all__ = ["load", "load_gpu", "bind", "set_int", "check", "last_error", "ClientOptions",
           "LoadPlanC", "ModelIdentityC", "ChunkSpecC", "ChunkInfoC", "GpuCacheDesc", "key_arg",
           "keys_arg", "buffer_address", "c_uint16", "c_uint32"]

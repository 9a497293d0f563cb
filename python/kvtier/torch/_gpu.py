"""kvtier's GPU path for PyTorch: paged KV caches on the GPU stored to and
loaded from kvtierd, layer by layer if wanted, and paged decode attention.

Everything runs in libkvtier (client/kvtier_c_gpu.h) through ctypes; this
module only describes torch tensors to it and checks them first: a wrong
shape, dtype or device raises ValueError / TypeError before anything is
launched. Work is queued on ``torch.cuda.current_stream()`` of the cache's
device unless a stream is given. Re-exported by ``kvtier.torch``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from kvtier import _native
from kvtier.client import TIER_NAMES
from kvtier.errors import DeadlineExceeded, KvtierError, error_for
from kvtier.keys import as_key

__all__ = [
    "PagedCache",
    "PendingStore",
    "LayerwiseLoad",
    "store",
    "store_batch",
    "begin_store",
    "load",
    "load_layerwise",
    "decode_attention",
    "close_gpu",
]

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPE_CODES[torch.float8_e4m3fn] = 3
_ALL_LAYERS = 0xFFFFFFFF

# ---- the library ---------------------------------------------------------------------

_vp = ctypes.c_void_p
_p_i32 = ctypes.POINTER(ctypes.c_int32)
_p_u64 = ctypes.POINTER(ctypes.c_uint64)
_lib = _native.load_gpu  # the library with its GPU functions bound
_check = _native.check


# ---- arguments ---------------------------------------------------------------------


def _u8(b: bytes):
    return (ctypes.c_uint8 * len(b)).from_buffer_copy(b)


def _ids(block_ids) -> ctypes.Array:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-D, not {tuple(block_ids.shape)}")
        block_ids = block_ids.detach().to("cpu", torch.int64).tolist()
    ids = [int(i) for i in block_ids]
    if not ids:
        raise ValueError("block_ids is empty")
    return (ctypes.c_int32 * len(ids))(*ids)


def _stream_handle(stream, device: torch.device) -> int:
    if stream is None:
        stream = torch.cuda.current_stream(device)
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)


def _layer_range(layers, num_layers: int) -> tuple[int, int]:
    if layers is None:
        return 0, num_layers
    if isinstance(layers, int):
        return layers, layers + 1
    if isinstance(layers, range):
        if layers.step != 1:
            raise ValueError("a layer range has step 1")
        b, e = layers.start, layers.stop
    else:
        b, e = layers
    if not 0 <= b < e <= num_layers:
        raise ValueError(f"layers [{b}, {e}) is not a non-empty range of [0, {num_layers})")
    return b, e


def _client_handle(client) -> int:
    """The kvtier_client* of a kvtier.Client (or of a raw handle)."""
    if isinstance(client, int):
        return client
    if isinstance(client, ctypes.c_void_p):
        return client.value or 0
    h = getattr(client, "handle", None)  # kvtier.Client: raises once closed
    if h is None:
        raise TypeError(f"{type(client).__name__} is not a kvtier client")
    return (h.value or 0) if isinstance(h, ctypes.c_void_p) else int(h)


# kvtier_gpu handles per client and device: {client: {device index: handle}}.
# A kvtier.Client is a weak key (its handles close with it: Client.close
# calls the callback registered here); a raw handle is a plain key.
_gpus_by_client: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_gpus_by_handle: dict = {}
_gpus_lock = threading.Lock()


def _close_handles(handles: dict) -> None:
    for g in handles.values():
        _lib().kvtier_gpu_close(_vp(g))
    handles.clear()


def _gpu(client, device: torch.device) -> int:
    h = _client_handle(client)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _gpus_lock:
        if isinstance(client, (int, ctypes.c_void_p)):
            handles = _gpus_by_handle.setdefault(h, {})
        else:
            handles = _gpus_by_client.get(client)
            if handles is None:
                handles = _gpus_by_client[client] = {}
                weakref.finalize(client, _close_handles, handles)
                on_close = getattr(client, "add_close_callback", None)
                if on_close is not None:  # kvtier.Client: closed before its pool is unmapped
                    on_close(functools.partial(_close_handles, handles))
        g = handles.get(idx)
        if g is None:
            out = _vp()
            _check(_lib().kvtier_gpu_open(_vp(h), idx, ctypes.byref(out)))
            g = handles[idx] = out.value
    return g


def open_gpu(client, device=None) -> float:
    """Registers the client's view of kvtierd's pool with CUDA for ``device``
    (default: the current device) now, instead of at the first store or load
    there. The registration pins the whole pool (a 16 GiB pool stalled a vLLM
    server for 1-2 s on the H200 host) and holds up the process's other CUDA
    calls while it runs, so an engine opens it at start, not between
    requests. Idempotent; closed with the client (or ``close_gpu``). Returns
    the seconds it took (about none when the handle was open already)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else \
        torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"open_gpu needs a CUDA device, not {dev}")
    t0 = time.perf_counter()
    _gpu(client, dev)
    return time.perf_counter() - t0


def close_gpu(client) -> None:
    """Unregisters the client's pool from CUDA (kvtier.Client.close does it too)."""
    with _gpus_lock:
        if isinstance(client, (int, ctypes.c_void_p)):
            handles = _gpus_by_handle.pop(_client_handle(client), None)
        else:
            handles = _gpus_by_client.pop(client, None)
    if handles:
        _close_handles(handles)


# ---- PagedCache ----------------------------------------------------------------------


def _check_tensor(t: torch.Tensor, what: str, dims: int, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{what} must be on a CUDA device, not {t.device}")
    if t.dim() != dims:
        raise ValueError(f"{what} must have {dims} dimensions, not shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{what} has dtype {t.dtype}; expected one of {sorted(map(str, dtypes))}")
    if t.stride(-1) != 1:
        raise ValueError(f"{what} must be contiguous in its last (head_dim) dimension")


def _same_layers(layers: Sequence[torch.Tensor], what: str) -> None:
    first = layers[0]
    for i, t in enumerate(layers):
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise ValueError(f"{what}[{i}] differs from {what}[0] in shape, strides or dtype")
        if t.device != first.device:
            raise ValueError(f"{what}[{i}] is on {t.device}, {what}[0] on {first.device}")


class PagedCache:
    """A paged KV cache on one GPU, described to libkvtier once.

    Holds references to the tensors it describes. ``num_layers``,
    ``num_blocks``, ``block_size``, ``num_kv_heads``, ``head_dim``, ``dtype``
    (the 16-bit dtype of the chunks) and ``device`` describe it. Build one
    with ``from_vllm``, ``from_separate`` or ``from_contiguous``.
    """

    def __init__(self, *, k_ptrs, v_ptrs, num_blocks, block_size, num_kv_heads, head_dim,
                 k_dtype, v_dtype, k_offset, v_offset, stride_block, stride_token, stride_head,
                 device, k_scale_ptrs=None, v_scale_ptrs=None, keep=(), max_tokens=None):
        self.num_layers = len(k_ptrs)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.k_dtype, self.v_dtype = k_dtype, v_dtype
        self.dtype = k_dtype if k_dtype in (torch.float16, torch.bfloat16) else (
            v_dtype if v_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
        self.device = torch.device(device)
        self.max_tokens = max_tokens  # contiguous caches: tokens of the row
        self._keep = keep
        self._handle = None
        if self.num_layers == 0:
            raise ValueError("a cache needs at least one layer")
        d = _native.GpuCacheDesc()
        _lib().kvtier_gpu_cache_desc_init(ctypes.byref(d))
        arr = lambda xs: (ctypes.c_uint64 * len(xs))(*[int(x) for x in xs])  # noqa: E731
        self._arrays = [arr(k_ptrs), arr(v_ptrs)]
        d.num_layers = self.num_layers
        d.num_blocks = self.num_blocks
        d.block_size = self.block_size
        d.num_kv_heads = self.num_kv_heads
        d.head_dim = self.head_dim
        d.k_dtype = _DTYPE_CODES[k_dtype]
        d.v_dtype = _DTYPE_CODES[v_dtype]
        d.k_layers = ctypes.cast(self._arrays[0], _p_u64)
        d.v_layers = ctypes.cast(self._arrays[1], _p_u64)
        if k_scale_ptrs is not None:
            self._arrays.append(arr(k_scale_ptrs))
            d.k_scale_layers = ctypes.cast(self._arrays[-1], _p_u64)
        if v_scale_ptrs is not None:
            self._arrays.append(arr(v_scale_ptrs))
            d.v_scale_layers = ctypes.cast(self._arrays[-1], _p_u64)
        d.k_offset, d.v_offset = int(k_offset), int(v_offset)
        d.stride_block, d.stride_token, d.stride_head = (int(stride_block), int(stride_token),
                                                         int(stride_head))
        d.device = (self.device.index if self.device.index is not None
                    else torch.cuda.current_device())
        out = _vp()
        _check(_lib().kvtier_gpu_cache_create(ctypes.byref(d), ctypes.byref(out)))
        self._handle = out.value

    def close(self) -> None:
        """Frees libkvtier's copy of the descriptor. REQUIRES: no queued work uses it."""
        if self._handle is not None:
            _lib().kvtier_gpu_cache_destroy(_vp(self._handle))
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"PagedCache(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, k={self.k_dtype}, v={self.v_dtype}, {self.device})")

    @classmethod
    def from_vllm(cls, kv_caches: Sequence[torch.Tensor],
                  layout: str = "flash_attn_nhd") -> PagedCache:
        """vLLM's per-layer KV tensors (16-bit; FP8 vLLM caches use from_separate).

        layout: ``"flash_attn_nhd"`` [2, num_blocks, block_size, kv_heads, head_dim],
        ``"flash_attn_hnd"`` [2, num_blocks, kv_heads, block_size, head_dim],
        ``"flashinfer_nhd"`` [num_blocks, 2, block_size, kv_heads, head_dim] or
        ``"flashinfer_hnd"`` [num_blocks, 2, kv_heads, block_size, head_dim].
        Any strides (views) are taken as they are.
        """
        layers = list(kv_caches)
        if not layers:
            raise ValueError("kv_caches is empty")
        for i, t in enumerate(layers):
            _check_tensor(t, f"kv_caches[{i}]", 5, (torch.float16, torch.bfloat16))
        _same_layers(layers, "kv_caches")
        t = layers[0]
        s = t.stride()
        if layout in ("flash_attn_nhd", "flash_attn_hnd"):
            if t.shape[0] != 2:
                raise ValueError(f"{layout}: dimension 0 must be 2 (K, V), shape {tuple(t.shape)}")
            nb, kv_off, sb = t.shape[1], s[0], s[1]
            rest = (2, 3, 4)
        elif layout in ("flashinfer_nhd", "flashinfer_hnd"):
            if t.shape[1] != 2:
                raise ValueError(f"{layout}: dimension 1 must be 2 (K, V), shape {tuple(t.shape)}")
            nb, kv_off, sb = t.shape[0], s[1], s[0]
            rest = (2, 3, 4)
        else:
            raise ValueError(f"unknown vLLM layout {layout!r}")
        if layout.endswith("nhd"):
            bs, h, st, sh = t.shape[rest[0]], t.shape[rest[1]], s[rest[0]], s[rest[1]]
        else:
            h, bs, sh, st = t.shape[rest[0]], t.shape[rest[1]], s[rest[0]], s[rest[1]]
        ptrs = [x.data_ptr() for x in layers]
        return cls(k_ptrs=ptrs, v_ptrs=ptrs, num_blocks=nb, block_size=bs, num_kv_heads=h,
                   head_dim=t.shape[4], k_dtype=t.dtype, v_dtype=t.dtype, k_offset=0,
                   v_offset=kv_off, stride_block=sb, stride_token=st, stride_head=sh,
                   device=t.device, keep=tuple(layers))

    @classmethod
    def from_separate(cls, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor],
                      layout: str = "nhd", k_scales: Sequence[torch.Tensor] | None = None,
                      v_scales: Sequence[torch.Tensor] | None = None) -> PagedCache:
        """Separate K and V tensors per layer: [num_blocks, block_size, kv_heads, head_dim]
        (``"nhd"``) or [num_blocks, kv_heads, block_size, head_dim] (``"hnd"``).

        K and V have the same shape and strides; each is BF16/FP16 or FP8 e4m3
        (``torch.float8_e4m3fn``), an FP8 one with float32 scales [num_blocks,
        kv_heads] per layer (k_scales / v_scales).
        """
        ks, vs = list(k_layers), list(v_layers)
        if not ks or len(ks) != len(vs):
            raise ValueError(f"k_layers ({len(ks)}) and v_layers ({len(vs)}) must be equal, "
                             "non-empty")
        dts = tuple(_DTYPE_CODES)
        for i in range(len(ks)):
            _check_tensor(ks[i], f"k_layers[{i}]", 4, dts)
            _check_tensor(vs[i], f"v_layers[{i}]", 4, dts)
        _same_layers(ks, "k_layers")
        _same_layers(vs, "v_layers")
        k, v = ks[0], vs[0]
        if k.shape != v.shape or k.stride() != v.stride() or k.device != v.device:
            raise ValueError(f"K {tuple(k.shape)}/{k.stride()} and V {tuple(v.shape)}/{v.stride()} "
                             "must have one shape, strides and device")
        s = k.stride()
        if layout == "nhd":
            nb, bs, h, d = k.shape
            sb, st, sh = s[0], s[1], s[2]
        elif layout == "hnd":
            nb, h, bs, d = k.shape
            sb, sh, st = s[0], s[1], s[2]
        else:
            raise ValueError(f"layout must be 'nhd' or 'hnd', not {layout!r}")

        def scales(xs, dtype, what):
            if dtype not in (torch.float16, torch.bfloat16):
                if xs is None or len(xs) != len(ks):
                    raise ValueError(f"an FP8 cache needs {what} (one [num_blocks, kv_heads] "
                                     "float32 per layer)")
                for i, x in enumerate(xs):
                    _check_tensor(x, f"{what}[{i}]", 2, (torch.float32,))
                    if tuple(x.shape) != (nb, h) or not x.is_contiguous() or x.device != k.device:
                        raise ValueError(f"{what}[{i}] must be contiguous [{nb}, {h}] on "
                                         f"{k.device}")
                return [x.data_ptr() for x in xs]
            return None

        ksp = scales(k_scales, k.dtype, "k_scales")
        vsp = scales(v_scales, v.dtype, "v_scales")
        return cls(k_ptrs=[x.data_ptr() for x in ks], v_ptrs=[x.data_ptr() for x in vs],
                   num_blocks=nb, block_size=bs, num_kv_heads=h, head_dim=d, k_dtype=k.dtype,
                   v_dtype=v.dtype, k_offset=0, v_offset=0, stride_block=sb, stride_token=st,
                   stride_head=sh, device=k.device, k_scale_ptrs=ksp, v_scale_ptrs=vsp,
                   keep=(tuple(ks), tuple(vs), k_scales, v_scales))

    @classmethod
    def from_contiguous(cls, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor],
                        block_size: int = 64, batch_index: int = 0) -> PagedCache:
        """A Hugging Face style cache: per layer K and V [batch, kv_heads, seq, head_dim]
        (BF16/FP16, e.g. ``DynamicCache`` layers), row ``batch_index`` seen as
        ceil(seq / block_size) virtual blocks of block_size tokens: block i
        holds tokens [i * block_size, (i + 1) * block_size). Tokens at or past
        ``seq`` must not be addressed (store/load check it).
        """
        ks, vs = list(k_layers), list(v_layers)
        if not ks or len(ks) != len(vs):
            raise ValueError(f"k_layers ({len(ks)}) and v_layers ({len(vs)}) must be equal, "
                             "non-empty")
        for i in range(len(ks)):
            _check_tensor(ks[i], f"k_layers[{i}]", 4, (torch.float16, torch.bfloat16))
            _check_tensor(vs[i], f"v_layers[{i}]", 4, (torch.float16, torch.bfloat16))
        _same_layers(ks, "k_layers")
        _same_layers(vs, "v_layers")
        k, v = ks[0], vs[0]
        if k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype:
            raise ValueError("K and V must have one shape, strides and dtype")
        b, h, seq, d = k.shape
        if not 0 <= batch_index < b:
            raise ValueError(f"batch_index {batch_index} is outside [0, {b})")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        s = k.stride()
        el = k.element_size()
        row = batch_index * s[0] * el
        return cls(k_ptrs=[x.data_ptr() + row for x in ks], v_ptrs=[x.data_ptr() + row for x in vs],
                   num_blocks=math.ceil(seq / block_size), block_size=block_size,
                   num_kv_heads=h, head_dim=d, k_dtype=k.dtype, v_dtype=v.dtype, k_offset=0,
                   v_offset=0, stride_block=block_size * s[2], stride_token=s[2],
                   stride_head=s[1], device=k.device, keep=(tuple(ks), tuple(vs)),
                   max_tokens=seq)

    def _check_span(self, ids, first_slot: int, num_tokens: int) -> None:
        if not 0 <= first_slot < self.block_size:
            raise ValueError(f"first_slot {first_slot} is outside [0, {self.block_size})")
        if num_tokens <= 0:
            raise ValueError("num_tokens must be positive")
        need = (first_slot + num_tokens + self.block_size - 1) // self.block_size
        if len(ids) < need:
            raise ValueError(f"{num_tokens} tokens from slot {first_slot} need {need} block ids, "
                             f"got {len(ids)}")
        # Each id is checked once, by the C API (InvalidArgument, per chunk of a batch).
        if self.max_tokens is not None:
            last = first_slot + num_tokens - 1
            block = ids[last // self.block_size]
            pos = block * self.block_size + last % self.block_size
            if 0 <= block < self.num_blocks and pos >= self.max_tokens:
                raise ValueError(f"token {num_tokens - 1} falls at position {pos}, past the "
                                 f"sequence length {self.max_tokens}")


# ---- store ---------------------------------------------------------------------------


def _fingerprint(fingerprint) -> bytes:
    if fingerprint is None:
        return bytes(16)
    if hasattr(fingerprint, "fingerprint"):
        fingerprint = fingerprint.fingerprint()
    return as_key(fingerprint)


def store(client, key, cache: PagedCache, block_ids, codec: str = "k16v8", *,
          fingerprint=None, num_tokens: int | None = None, first_slot: int = 0,
          stream=None, durable: bool = False, wait: bool = True) -> PendingStore | None:
    """Encodes tokens of ``cache`` on the GPU straight into kvtierd's pool and stores them
    as ``key``.

    Token t (0 <= t < num_tokens) is at block ``block_ids[(first_slot + t) //
    block_size]``, slot ``(first_slot + t) % block_size`` (block_ids: ints, a
    list or a 1-D tensor). ``num_tokens`` defaults to ``len(block_ids) *
    block_size - first_slot``. ``fingerprint``: 16 bytes / hex / a
    ``kvtier.ModelIdentity`` (default zeros). Runs after the work queued on
    ``stream`` (default: the current stream of the cache's device) and
    returns once the daemon committed the chunk (``durable``: on NVMe).
    ``wait=False`` returns once the encode and the copy are queued, with the
    store's handle: a libkvtier thread commits the chunk, and the handle's
    ``wait()`` gives the result (``close()`` it either way).
    To store layer by layer while a prefill runs, use ``begin_store``.
    """
    ids = _ids(block_ids)
    if num_tokens is None:
        num_tokens = len(ids) * cache.block_size - first_slot
    cache._check_span(ids, first_slot, num_tokens)
    if not wait:
        op = begin_store(client, cache, num_tokens, codec, fingerprint=fingerprint)
        try:
            op.encode_layers(ids, None, first_slot, stream)
            op.commit(key, durable, wait=False)
        except BaseException:
            op.close()
            raise
        return op
    fp = _fingerprint(fingerprint)
    lib = _lib()
    _check(lib.kvtier_gpu_store(
        _vp(_gpu(client, cache.device)), _u8(as_key(key)), _u8(fp), codec.encode(),
        _vp(cache._handle), ids, len(ids), first_slot, num_tokens,
        _stream_handle(stream, cache.device), int(durable)))
    return None


def store_batch(client, keys: Sequence, cache: PagedCache, block_ids_per_key: Sequence,
                codec: str = "k16v8", *, fingerprint=None, stream=None,
                durable: bool = False) -> list:
    """``store`` of many chunks in one call: chunk ``keys[i]`` from the blocks
    ``block_ids_per_key[i]`` (the same number of blocks for each, every block's
    tokens). The encodes of later chunks run on ``stream`` while kvtierd commits
    earlier ones, and the calling thread holds the GIL only to start the call.
    Returns one entry per chunk: None if stored, else its KvtierError (a chunk
    that fails does not stop the others). Raises ValueError for bad arguments."""
    keys = list(keys)
    per = [_ids(ids) for ids in block_ids_per_key]
    if len(keys) != len(per):
        raise ValueError(f"keys ({len(keys)}) and block_ids_per_key ({len(per)}) differ in "
                         "length")
    if not keys:
        return []
    num_ids = len(per[0])
    if any(len(ids) != num_ids for ids in per):
        raise ValueError("every chunk of a store_batch has the same number of blocks")
    num_tokens = num_ids * cache.block_size
    for ids in per:
        cache._check_span(ids, 0, num_tokens)
    n = len(keys)
    flat = (ctypes.c_int32 * (n * num_ids))()
    for i, ids in enumerate(per):
        ctypes.memmove(ctypes.byref(flat, 4 * i * num_ids), ids, 4 * num_ids)
    statuses = (ctypes.c_int * n)()
    rc = _lib().kvtier_gpu_store_batch(
        _vp(_gpu(client, cache.device)), _u8(b"".join(as_key(k) for k in keys)), n,
        _u8(_fingerprint(fingerprint)), codec.encode(), _vp(cache._handle), flat, num_ids, 0,
        num_tokens, _stream_handle(stream, cache.device), int(durable), statuses)
    if rc == 0:
        return [None] * n
    if not any(statuses):
        _check(rc)  # the call failed as a whole: nothing was stored
    # The C API keeps the message of the first failed chunk.
    reason = _native.last_error()
    out: list = []
    for i, code in enumerate(statuses):
        if code == 0:
            out.append(None)
        else:
            first = all(e is None for e in out)
            out.append(error_for(code, reason if first else f"chunk {i} of the batch: status "
                                                           f"{code}"))
    return out


class PendingStore:
    """A chunk encoded layer range by layer range (``begin_store``)."""

    def __init__(self, handle: int | None, cache: PagedCache, num_tokens: int):
        self._handle = handle
        self._cache = cache
        self.num_tokens = num_tokens
        self._committing = False  # commit(wait=False) started; wait() answers

    def encode_layers(self, block_ids, layers, first_slot: int = 0, stream=None) -> None:
        """Queues the encode of ``layers`` (a range, (begin, end) or an int) on ``stream``
        without waiting; ranges come in order from layer 0, without gaps."""
        if self._handle is None or self._committing:
            raise ValueError("the store was committed or closed")
        b, e = _layer_range(layers, self._cache.num_layers)
        ids = _ids(block_ids)
        self._cache._check_span(ids, first_slot, self.num_tokens)
        _check(_lib().kvtier_gpu_store_layers(
            _vp(self._handle), _vp(self._cache._handle), ids, len(ids), first_slot, b, e,
            _stream_handle(stream, self._cache.device)))

    def commit(self, key, durable: bool = False, wait: bool = True) -> None:
        """Waits for the encodes, then stores the chunk as ``key``. ``wait=False``
        returns at once: a libkvtier thread commits, and ``wait()`` gives the
        result to a caller that wants it (``close()`` does not wait for it)."""
        if self._handle is None or self._committing:
            raise ValueError("the store was committed or closed")
        if not wait:
            _check(_lib().kvtier_gpu_store_commit_async(_vp(self._handle), _u8(as_key(key)),
                                                        int(durable)))
            self._committing = True
            return
        try:
            _check(_lib().kvtier_gpu_store_commit(_vp(self._handle), _u8(as_key(key)),
                                                  int(durable)))
        finally:
            self.close()

    def wait(self, timeout: float | None = None) -> None:
        """The result of ``commit(wait=False)``: returns once the chunk is stored,
        raises its KvtierError, or DeadlineExceeded when ``timeout`` (seconds)
        passed first (ask again)."""
        if self._handle is None or not self._committing:
            raise ValueError("no commit(wait=False) to wait for")
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        _check(_lib().kvtier_gpu_store_wait(_vp(self._handle), ms))

    def done(self) -> bool:
        """Whether the asynchronous commit has finished (stored or failed)."""
        try:
            self.wait(0)
        except DeadlineExceeded:
            return False
        except KvtierError:
            return True
        return True

    def close(self) -> None:
        """Abandons the store unless committed (waits for its queued encodes); an
        asynchronous commit goes on, unwaited."""
        if self._handle is not None:
            _lib().kvtier_gpu_store_release(_vp(self._handle))
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def begin_store(client, cache: PagedCache, num_tokens: int, codec: str = "k16v8", *,
                fingerprint=None) -> PendingStore:
    """Reserves a slot for a chunk of ``num_tokens`` tokens of ``cache`` to be encoded by
    layer ranges (``PendingStore.encode_layers``) and stored by ``commit``."""
    out = _vp()
    _check(_lib().kvtier_gpu_store_begin(
        _vp(_gpu(client, cache.device)), _u8(_fingerprint(fingerprint)), codec.encode(),
        _vp(cache._handle), int(num_tokens), ctypes.byref(out)))
    return PendingStore(out.value, cache, int(num_tokens))


# ---- load ----------------------------------------------------------------------------


def load(client, key, cache: PagedCache, block_ids, first_slot: int = 0, layers=None,
         stream=None) -> str:
    """Decodes chunk ``key`` into ``cache`` at ``block_ids`` from ``first_slot`` (only
    ``layers`` if given: a range, (begin, end) or an int) and returns the tier it came
    from ("dram", "nvme", ...). Ordered after the work on ``stream``; returns once the
    decode has finished. A miss raises NotFound."""
    ids = _ids(block_ids)
    b, e = _layer_range(layers, cache.num_layers)
    if not 0 <= first_slot < cache.block_size:
        raise ValueError(f"first_slot {first_slot} is outside [0, {cache.block_size})")
    tier = ctypes.c_int(0)
    _check(_lib().kvtier_gpu_load(
        _vp(_gpu(client, cache.device)), _u8(as_key(key)), _vp(cache._handle), ids, len(ids),
        first_slot, b, e, _stream_handle(stream, cache.device), ctypes.byref(tier)))
    return TIER_NAMES.get(tier.value, "unknown")


class LayerwiseLoad:
    """Chunks being decoded layer group by layer group (``load_layerwise``)."""

    def __init__(self, handle: int | None, cache: PagedCache, n: int):
        self._handle = handle
        self._cache = cache
        self._n = n
        self.tiers: list | None = None
        self.statuses: list | None = None

    def wait_layer(self, layer: int, stream=None) -> None:
        """Makes ``stream`` (default: the current one) wait on the device until ``layer``
        of every found chunk is in the cache; the host does not block."""
        if self._handle is None:
            raise ValueError("the load is finished")
        if not 0 <= layer < self._cache.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self._cache.num_layers})")
        _check(_lib().kvtier_gpu_layerwise_wait_layer(
            _vp(self._handle), layer, _stream_handle(stream, self._cache.device)))

    def finish(self) -> list:
        """Waits for every decode and releases the chunks. Returns each chunk's tier
        ("dram", ...) or None for a chunk that was missing or corrupt (not decoded);
        ``statuses`` holds the status codes (0, 5 NOT_FOUND, 15 DATA_LOSS, ...)."""
        if self._handle is None:
            return self.tiers or []
        st = (ctypes.c_int * self._n)()
        tr = (ctypes.c_int * self._n)()
        try:
            _check(_lib().kvtier_gpu_layerwise_finish(_vp(self._handle), st, tr))
        finally:
            _lib().kvtier_gpu_layerwise_release(_vp(self._handle))
            self._handle = None
        self.statuses = list(st)
        self.tiers = [(TIER_NAMES.get(t, "unknown") if s == 0 else None)
                      for s, t in zip(st, tr, strict=True)]
        return self.tiers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()

    def __del__(self):
        try:
            if self._handle is not None:
                _lib().kvtier_gpu_layerwise_release(_vp(self._handle))
        except Exception:
            pass


def load_layerwise(client, keys: Sequence, cache: PagedCache, block_ids_per_key: Sequence,
                   layer_group: int = 1, stream=None,
                   first_slots: Sequence[int] | None = None) -> LayerwiseLoad:
    """Holds every chunk of ``keys`` and checks its header (several at once), then
    queues on ``stream``, per group of ``layer_group`` layers, the decode of that group
    of every found chunk followed by an event. Returns without waiting for the device:
    call ``wait_layer(l)`` before computing layer l, ``finish()`` at the end. The
    chunks' checksums are verified after or while they decode (on the GPU, over the
    copy the kernels read; ``KVTIER_GPU_VERIFY=host``: on host threads), so what the
    load put in the cache is trustworthy only for the chunks that ``finish()`` reports
    good; a chunk it reports corrupt (DataLoss) was decoded from bad bytes."""
    keys = list(keys)
    per = list(block_ids_per_key)
    if not keys or len(keys) != len(per):
        raise ValueError(f"keys ({len(keys)}) and block_ids_per_key ({len(per)}) must be equal, "
                         "non-empty")
    if layer_group <= 0:
        raise ValueError("layer_group must be positive")
    flat: list[int] = []
    offsets: list[int] = []
    counts: list[int] = []
    for ids in per:
        lst = _ids(ids)
        offsets.append(len(flat))
        counts.append(len(lst))
        flat.extend(lst)
    n = len(keys)
    slots = list(first_slots) if first_slots is not None else [0] * n
    for s in slots:
        if not 0 <= s < cache.block_size:
            raise ValueError(f"first_slot {s} is outside [0, {cache.block_size})")
    key_buf = b"".join(as_key(k) for k in keys)
    out = _vp()
    _check(_lib().kvtier_gpu_load_layerwise(
        _vp(_gpu(client, cache.device)), _u8(key_buf), n, _vp(cache._handle),
        (ctypes.c_int32 * len(flat))(*flat), (ctypes.c_uint64 * n)(*offsets),
        (ctypes.c_uint32 * n)(*counts), (ctypes.c_uint32 * n)(*slots), layer_group,
        _stream_handle(stream, cache.device), ctypes.byref(out)))
    return LayerwiseLoad(out.value, cache, n)


# ---- attention -----------------------------------------------------------------------


def decode_attention(q: torch.Tensor, cache: PagedCache, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, layer: int, sm_scale: float | None = None,
                     out: torch.Tensor | None = None, check: bool = False) -> torch.Tensor:
    """One decode step of attention over the paged cache, on the current stream.

    q: [batch, num_q_heads, head_dim], the cache's 16-bit dtype, contiguous, on the
    cache's device (num_q_heads a multiple of kv_heads, at most 8 q heads per kv head).
    block_table: int32 [batch, max_blocks_per_seq]; seq_lens: int32 [batch] (each in
    [1, max_blocks_per_seq * block_size]); both on the device. sm_scale defaults to
    1/sqrt(head_dim). Returns out [batch, num_q_heads, head_dim] (q's dtype).
    check=True copies block_table and seq_lens to the host and checks every id and
    length first (a device sync). Tolerance against an FP32 reference:
    kernels/README.md.
    """
    _check_tensor(q, "q", 3, (torch.float16, torch.bfloat16))
    if not q.is_contiguous():
        raise ValueError("q must be contiguous")
    if q.device != cache.device and not (cache.device.index is None and q.device.type == "cuda"):
        raise ValueError(f"q is on {q.device}, the cache on {cache.device}")
    if q.dtype != cache.dtype:
        raise TypeError(f"q has dtype {q.dtype}; the cache holds {cache.dtype}")
    batch, hq, d = q.shape
    if d != cache.head_dim:
        raise ValueError(f"q head_dim {d} != the cache's {cache.head_dim}")
    if hq % cache.num_kv_heads != 0:
        raise ValueError(f"num_q_heads {hq} is not a multiple of kv_heads {cache.num_kv_heads}")
    for t, what, dims in ((block_table, "block_table", 2), (seq_lens, "seq_lens", 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor")
        if t.dtype != torch.int32:
            raise TypeError(f"{what} must be int32, not {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{what} is on {t.device}, q on {q.device}")
        if t.dim() != dims or not t.is_contiguous():
            raise ValueError(f"{what} must be a contiguous {dims}-D tensor")
    if block_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(f"block_table {tuple(block_table.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match batch {batch}")
    if not 0 <= layer < cache.num_layers:
        raise ValueError(f"layer {layer} is outside [0, {cache.num_layers})")
    if out is None:
        out = torch.empty_like(q)
    elif (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
          or not out.is_contiguous()):
        raise ValueError("out must be a contiguous tensor of q's shape, dtype and device")
    host_bt = host_sl = None
    if check:
        bt = block_table.cpu()
        sl = seq_lens.cpu()
        host_bt = ctypes.cast(bt.data_ptr(), _p_i32)
        host_sl = ctypes.cast(sl.data_ptr(), _p_i32)
        keep = (bt, sl)  # noqa: F841 (alive through the call)
    scale = float(sm_scale) if sm_scale is not None else 0.0
    _check(_lib().kvtier_attention_decode(
        _vp(cache._handle), q.data_ptr(), _DTYPE_CODES[q.dtype], batch, hq,
        block_table.data_ptr(), host_bt, block_table.shape[1], seq_lens.data_ptr(), host_sl,
        layer, scale, out.data_ptr(), _stream_handle(None, q.device)))
    return out

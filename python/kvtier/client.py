"""kvtier.Client: a connection to kvtierd (libkvtier's KvtierClient).

Over the daemon's Unix socket chunk bytes move through its shared-memory pool:
a put copies into a pool slot, a get hands out the chunk where it lies in the
pool (zero-copy, pinned in the daemon until released). Over TCP (addr=) bytes
travel inline and a bearer token is required.
"""
from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier import _native
from kvtier.errors import InvalidArgument, KvtierError, error_for
from kvtier.keys import Key, as_key

TIER_NAMES = {0: "unknown", 1: "hbm", 2: "dram", 3: "nvme", 4: "remote"}


class _Hold:
    """Owns one kvtier_held handle; releases it when released or collected.
    The ctypes array that maps the chunk's bytes references it, so the hold
    outlives every view of those bytes."""

    __slots__ = ("_handle", "_lib", "__weakref__")

    def __init__(self, handle, lib):
        self._handle = handle
        self._lib = lib

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle:
            _native.check(self._lib.kvtier_release(handle))

    def __del__(self):
        handle, self._handle = self._handle, None
        if handle:
            self._lib.kvtier_release(handle)


class Chunk:
    """A chunk read from kvtierd. `data` is a read-only memoryview of its bytes:
    in place in the daemon's pool when the client maps it (the chunk stays
    pinned there until release()), else a private copy. The checksums of the
    bytes were verified when it was read.

    The hold lasts while any view of the bytes exists: release() (or the end
    of a `with` block) drops the chunk's own view, and the hold ends as soon
    as no slice or array made from `data` is left. A view can never outlive
    the bytes it shows."""

    def __init__(self, hold: _Hold, address: int, size: int, tier: str):
        arr = (ctypes.c_ubyte * size).from_address(address) if size else (ctypes.c_ubyte * 0)()
        # The hold lives as long as the bytes are viewed (ctypes keeps attributes in the
        # array's __dict__; typeshed declares none on Array).
        arr.__dict__["_kvtier_hold"] = hold
        self._hold: _Hold | None = hold
        self._view: memoryview | None = memoryview(arr).cast("B").toreadonly()
        self.tier = tier
        self.size = size

    @property
    def data(self) -> memoryview:
        if self._view is None:
            raise ValueError("chunk was released")
        return self._view

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return bytes(self.data)

    def release(self) -> None:
        """Drops this chunk's view of its bytes. The hold ends at once when no
        other view of them exists, else when the last one is gone."""
        if self._view is None:
            return
        view, self._view = self._view, None
        hold, self._hold = self._hold, None
        try:
            view.release()
        except BufferError:
            pass  # views exported from it keep the bytes, and the hold, alive
        del view, hold

    def __enter__(self) -> Chunk:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._view is None else f"{self.size} bytes"
        return f"<kvtier.Chunk {state} from {self.tier}>"


@dataclass
class LoadPlan:
    """The cached prefix of a request and what loading it costs.

    hits: leading keys that are cached; tiers/chunk_bytes/load_us: per hit.
    load_chunks: leading hits worth loading rather than recomputing (with a
    prefill rate; without one, every hit); load_chunks_us: their estimated
    load time; saved_us: the recompute time that loading them saves."""
    hits: int
    load_chunks: int
    load_chunks_us: float
    saved_us: float
    tiers: list = field(default_factory=list)
    chunk_bytes: list = field(default_factory=list)
    load_us: list = field(default_factory=list)


@dataclass(frozen=True)
class HostPage:
    """Where one page's K and V live in this process's memory: the
    kv_heads*head_dim 16-bit elements of (layer l, token t) start at
    ``k + 2 * (l * layer_stride + t * token_stride)`` (addresses in bytes,
    strides in elements; likewise ``v``). ``HostPage.of(k, v)`` for tensors
    [layers, tokens, kv_heads, head_dim] whose heads and dims are dense."""
    k: int
    v: int
    layer_stride: int
    token_stride: int

    @classmethod
    def of(cls, k, v) -> HostPage:
        if k.shape != v.shape or k.stride() != v.stride() or k.dim() != 4:
            raise InvalidArgument(3, "K and V must be 4-D views of the same shape and strides")
        if k.device.type != "cpu" or v.device.type != "cpu":
            raise InvalidArgument(3, f"K and V must be in host memory, not {k.device}")
        if k.element_size() != 2:
            raise InvalidArgument(3, f"K and V must be 16-bit, not {k.dtype}")
        _, _, heads, dim = k.shape
        sl, st, sh, sd = k.stride()
        if sd != 1 or (heads > 1 and sh != dim):
            raise InvalidArgument(3, "a row (kv_heads x head_dim) must be dense; strides "
                                     f"{k.stride()}")
        return cls(k.data_ptr(), v.data_ptr(), sl, st)


@dataclass(frozen=True)
class PagesResult:
    """put_pages / get_pages: each page's error (None for success) and the
    encoded bytes moved."""
    errors: list
    bytes: int


class Client:
    """A client of kvtierd; safe to share between threads.

    socket: the daemon's Unix socket (default ./kvtier-data/kvtierd.sock);
    addr: "HOST:PORT" of its TCP listener instead (bytes travel inline);
    token / token_file: the bearer token (required on TCP);
    tls_ca: PEM file of the CA that signed the daemon's TLS certificate (TLS
    over TCP); tls_cert / tls_key: PEM files of a client certificate for a
    daemon that requires one (mutual TLS); tls_server_name: the name the
    daemon's certificate is checked against instead of addr's host;
    timeout_ms: deadline of each call; shared_memory: map the daemon's pool
    (Unix socket only). Raises Unavailable if the daemon does not answer."""

    def __init__(self, socket: str | None = None, addr: str | None = None,
                 token: str | None = None, token_file: str | None = None,
                 timeout_ms: int = 60000, shared_memory: bool = True,
                 max_data_connections: int | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_server_name: str | None = None):
        self._close_callbacks: list[Callable[[], None]] = []
        self._lib = _native.load()
        opts = _native.ClientOptions()
        self._lib.kvtier_client_options_init(ctypes.byref(opts))
        if socket is not None:
            opts.socket_path = os.fsencode(socket)
        if addr is not None:
            opts.tcp_addr = addr.encode()
        if token is not None:
            opts.token = token.encode()
        if token_file is not None:
            opts.token_file = os.fsencode(token_file)
        for name, path in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key)):
            if path is not None:
                setattr(opts, name, os.fsencode(path))
        if tls_server_name is not None:
            opts.tls_server_name = tls_server_name.encode()
        _native.set_int(opts, "timeout_ms", timeout_ms)
        opts.shared_memory = 1 if shared_memory else 0
        if max_data_connections is not None:
            _native.set_int(opts, "max_data_connections", max_data_connections)
        handle = ctypes.c_void_p()
        self._handle = None
        _native.check(self._lib.kvtier_client_open(ctypes.byref(opts), ctypes.byref(handle)))
        self._handle = handle

    # -- lifetime --
    def close(self) -> None:
        """Closes the client: later calls raise ValueError. Chunks read
        through it stay readable and keep their holds until released; the
        connection and the pool mapping go with the last of them."""
        callbacks, self._close_callbacks = self._close_callbacks, []
        if self._handle:
            for fn in callbacks:  # before the pool is unmapped
                fn()
        handle, self._handle = self._handle, None
        if handle:
            self._lib.kvtier_client_close(handle)

    def add_close_callback(self, fn: Callable[[], None]) -> None:
        """Calls fn() once when the client closes, before its connection and
        pool mapping go (kvtier.torch unregisters the pool from CUDA there)."""
        self._close_callbacks.append(fn)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _h(self):
        if not self._handle:
            raise ValueError("client is closed")
        return self._handle

    @property
    def uses_shared_memory(self) -> bool:
        return bool(self._lib.kvtier_client_uses_shared_memory(self._h()))

    # -- chunks --
    def put(self, key: Key, data, durable: bool = False) -> None:
        """Stores an encoded chunk (any contiguous buffer). The daemon verifies
        it first: InvalidArgument / DataLoss for bad bytes. durable: return
        only once it is committed on the NVMe tier."""
        k = as_key(key)
        addr, n, keep = _native.buffer_address(data)
        _native.check(self._lib.kvtier_put(self._h(), _native.key_arg(k), addr, n, int(durable)))
        del keep

    def get(self, key: Key) -> Chunk:
        """The chunk's bytes, verified (see Chunk). NotFound on a miss,
        DataLoss if the stored chunk is corrupt (the daemon drops it)."""
        k = as_key(key)
        held = ctypes.c_void_p()
        data = ctypes.c_void_p()
        size = ctypes.c_uint64()
        tier = ctypes.c_int()
        _native.check(self._lib.kvtier_get(self._h(), _native.key_arg(k), ctypes.byref(held),
                                           ctypes.byref(data), ctypes.byref(size),
                                           ctypes.byref(tier)))
        hold = _Hold(held, self._lib)
        return Chunk(hold, data.value or 0, size.value, TIER_NAMES.get(tier.value, "unknown"))

    def get_bytes(self, key: Key) -> bytes:
        """A copy of the chunk's bytes (get + release)."""
        with self.get(key) as chunk:
            return bytes(chunk.data)

    def delete(self, key: Key) -> None:
        _native.check(self._lib.kvtier_delete(self._h(), _native.key_arg(as_key(key))))

    # -- host KV pages --
    def put_pages(self, spec, keys: Sequence[Key], pages: Sequence[HostPage],
                  threads: int = 8) -> PagesResult:
        """Encodes each page (a HostPage of 16-bit rows in this process's
        memory, spec's shape) as a chunk of ``spec`` (kvtier.codec.ChunkSpec)
        and stores it under its key, the pages on up to ``threads`` threads in
        one native call. Through shared memory a chunk is encoded straight
        into the daemon's pool. The memory must stay valid during the call."""
        return self._pages(self._lib.kvtier_put_pages, spec, keys, pages, threads)

    def get_pages(self, spec, keys: Sequence[Key], pages: Sequence[HostPage],
                  threads: int = 8) -> PagesResult:
        """Decodes the chunk of each key into its page (as put_pages), each
        layer record checked just before it is decoded. A page's error:
        NotFound on a miss, InvalidArgument for a chunk whose model, dtype or
        shape is not ``spec``'s, DataLoss for corrupt bytes (the daemon drops
        the chunk; the page may hold part of it)."""
        return self._pages(self._lib.kvtier_get_pages, spec, keys, pages, threads)

    def _pages(self, fn, spec, keys, pages, threads: int) -> PagesResult:
        ks = [as_key(k) for k in keys]
        if len(ks) != len(pages):
            raise InvalidArgument(3, f"{len(ks)} keys for {len(pages)} pages")
        n = len(ks)
        c_pages = (_native.HostPageC * max(1, n))()
        for i, p in enumerate(pages):
            c_pages[i] = _native.HostPageC(p.k, p.v, p.layer_stride, p.token_stride)
        status = (ctypes.c_int * max(1, n))()
        nbytes = ctypes.c_uint64()
        rc = fn(self._h(), ctypes.byref(spec._c()), _native.keys_arg(ks), n, c_pages,
                max(1, int(threads)), status, ctypes.byref(nbytes))
        # The message is the first failed page's; a page's own error keeps it
        # when it is that page's.
        message = _native.last_error() if rc else ""
        errors: list[KvtierError | None] = []
        for i in range(n):
            code = status[i]
            if code == 0:
                errors.append(None)
            else:
                errors.append(error_for(code, message if message.startswith(f"page {i}:")
                                        else f"page {i}"))
        return PagesResult(errors, nbytes.value)

    # -- lookups --
    def lookup(self, keys: Sequence[Key]) -> list[str]:
        """Fastest tier of each key of the longest cached prefix of `keys`
        (keys in prefix order); its length is the number of cached chunks."""
        ks = [as_key(k) for k in keys]
        tiers = (ctypes.c_uint8 * max(1, len(ks)))()
        hits = ctypes.c_size_t()
        _native.check(self._lib.kvtier_lookup(self._h(), _native.keys_arg(ks), len(ks), tiers,
                                              ctypes.byref(hits)))
        return [TIER_NAMES.get(tiers[i], "unknown") for i in range(hits.value)]

    def plan_load(self, keys: Sequence[Key], prefill_tokens_per_s: float = 0.0,
                  tokens_per_chunk: int = 256,
                  attention_doubling_tokens: float = 0.0) -> LoadPlan:
        """The cached prefix with each hit's size and estimated load time;
        with the engine's prefill rate (tokens/s), how many leading hits are
        worth loading rather than recomputing.

        attention_doubling_tokens: C2, the context length in tokens at which
        one token's prefill costs twice its short-context cost
        (``kvtier.engine.attention_doubling_tokens`` derives it from a model
        config); ``prefill_tokens_per_s`` is then the short-context rate r, and
        the chunk of tokens [a, a + n) recomputes in
        1e6 * n / r * (1 + (a + n/2) / C2) microseconds. 0: linear, n / r.
        Raises InvalidArgument for a negative or non-finite rate or C2.
        """
        ks = [as_key(k) for k in keys]
        n = max(1, len(ks))
        tiers = (ctypes.c_uint8 * n)()
        sizes = (ctypes.c_uint64 * n)()
        load_us = (ctypes.c_double * n)()
        p = _native.LoadPlanC()
        p.struct_size = ctypes.sizeof(p)
        p.tiers = tiers
        p.chunk_bytes = sizes
        p.load_us = load_us
        _native.check(self._lib.kvtier_plan_load_attention(
            self._h(), _native.keys_arg(ks), len(ks), float(prefill_tokens_per_s),
            float(attention_doubling_tokens), int(tokens_per_chunk), ctypes.byref(p)))
        h = p.hits
        return LoadPlan(h, p.load_chunks, p.load_chunks_us, p.saved_us,
                        [TIER_NAMES.get(tiers[i], "unknown") for i in range(h)],
                        [sizes[i] for i in range(h)], [load_us[i] for i in range(h)])

    def prefetch(self, keys: Sequence[Key], deadline_ms: int = 1000) -> bool:
        """Moves present chunks into DRAM; True if all arrived in time."""
        ks = [as_key(k) for k in keys]
        done = ctypes.c_int()
        _native.check(self._lib.kvtier_prefetch(self._h(), _native.keys_arg(ks), len(ks),
                                                int(deadline_ms), ctypes.byref(done)))
        return bool(done.value)

    def stats(self) -> dict:
        """{"tiers": [{"tier", "capacity_bytes", "used_bytes", "chunks",
        "read_bytes_per_s", "write_bytes_per_s"}], "counters": {name: n}}"""
        out = ctypes.c_void_p()
        _native.check(self._lib.kvtier_stats_json(self._h(), ctypes.byref(out)))
        try:
            return json.loads(ctypes.string_at(out).decode())
        finally:
            self._lib.kvtier_free(out)

    # -- GPU paged caches (kvtier.torch) --
    def store(self, key: Key, cache, block_ids, codec: str = "k16v8", **kwargs) -> None:
        """Encodes the tokens at `block_ids` of a GPU paged cache straight into
        the daemon's pool and stores them as `key` (kvtier.torch.store)."""
        from kvtier import torch as kt
        kt.store(self, key, cache, block_ids, codec=codec, **kwargs)

    def load(self, key: Key, cache, block_ids, **kwargs) -> str:
        """Decodes chunk `key` from the daemon's pool into the GPU paged cache
        at `block_ids`; returns the tier it came from (kvtier.torch.load)."""
        from kvtier import torch as kt
        return kt.load(self, key, cache, block_ids, **kwargs)

    @property
    def handle(self):
        """The C handle (kvtier_client*), for kvtier.torch."""
        return self._h()


__all__ = ["Client", "Chunk", "LoadPlan", "TIER_NAMES", "KvtierError"]

"""kvtier as an SGLang HiCache storage backend: ``KvtierHiCacheStorage``.

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1, "socket": "/run/kvtier/kvtierd.sock", "codec": "k16v8"}'

One SGLang page (``--page-size`` tokens) is one kvtier chunk: K and V of the
page's tokens for every layer of this rank, [layers, page_size, kv_heads,
head_dim], encoded with the configured codec, so ``chunk_tokens`` is the page
size. ``interface_v1`` makes SGLang call the zero-copy ``batch_get_v1`` /
``batch_set_v1``, which encode from and decode into SGLang's host pool in
place (layouts ``page_first``, ``page_first_direct`` and ``layer_first``).

Keys. SGLang hands a storage backend its own page hashes (SHA-256 hex over
the page's token ids), never the token ids, so the backend cannot derive
kvtier's token-chain keys (``kvtier.engine``) from them. A key of 32 hex
digits is taken as a kvtier key as it is, which is how a caller that has the
tokens (``kvtier.prefix_keys``) reaches chunks stored by vLLM or kvtier.hf;
any other key string is mapped into kvtier's key space under this model's
identity (``kvtier_key``), so ranks, models and codecs never collide.
"""
from __future__ import annotations

import array
import hashlib
import logging
import math
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import kvtier
import kvtier.codec
from kvtier.integrations import engine

logger = logging.getLogger("kvtier.sglang")

#: Keys of SGLang's extra config that SGLang itself reads.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1",
               "enable_metadata_cache", "metadata_ttl", "tp_lcm_size")
HOST_LAYOUTS = ("page_first", "page_first_direct", "layer_first")

class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang's L3 storage over kvtierd (see the module comment).

    storage_config: SGLang's HiCacheStorageConfig; its extra_config carries
    ``kvtier.engine.ConnectorSettings`` (chunk_tokens is ignored: a chunk is
    one page). The host pool arrives by ``register_mem_pool_host``. SGLang
    calls the backend from its prefetch and backup threads at once: the
    client is thread-safe and the counters are guarded by a lock.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        if storage_config.is_mla_model:
            raise ValueError("kvtier stores K and V per head; MLA models are not supported")
        # A pipeline stage holds other layers, an attention context-parallel
        # rank other tokens, under the same page keys.
        for field, flag in (("pp_size", "--pp-size"), ("attn_cp_size", "--attn-cp-size")):
            size = int(getattr(storage_config, field, 1) or 1)
            if size > 1:
                raise ValueError(f"kvtier does not support {field} {size}: its ranks hold other "
                                 f"layers or tokens under the same page keys. Run with {flag} 1 "
                                 "(tensor parallelism is supported).")
        self.storage_config = storage_config
        self.settings = engine.ConnectorSettings.from_mapping(storage_config.extra_config,
                                                              ignore=SGLANG_KEYS)
        self.model_id = self.settings.model_id or storage_config.model_name or ""
        self.client = self.settings.connect()
        self.lookup = engine.BoundedLookup(self.settings.connect, self.settings.lookup_timeout_ms,
                                           self.settings.retry_after_ms)
        self.mem_pool_host: Any = None  # SGLang's HostKVCache
        self.identity: kvtier.ModelIdentity | None = None
        self._fingerprint: bytes | None = None
        self._mu = threading.Lock()
        self._written: set = set()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}
        self.errors = 0  # guarded by _mu

    # ---- host pool --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"kvtier needs --hicache-mem-layout in {HOST_LAYOUTS}, not {layout!r}")
        buf = getattr(mem_pool_host, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or buf.shape[0] != 2:
            raise ValueError("kvtier needs an MHA host pool (K and V buffers)")
        super().register_mem_pool_host(mem_pool_host)
        self.page_size = int(mem_pool_host.page_size)
        self.layers = int(mem_pool_host.layer_num)
        self.identity = engine.engine_identity(
            self.model_id, mem_pool_host.dtype, self.settings.codec,
            revision=self.settings.revision, tp_world_size=self.storage_config.tp_size,
            tp_rank=self.storage_config.tp_rank)
        self._fingerprint = self.identity.fingerprint()

    def _page(self, index: int):
        """Views K and V [layers, page_size, kv_heads, head_dim] of the host page at token
        ``index``."""
        pool = self.mem_pool_host
        buf, ps = pool.kv_buffer, self.page_size
        if index % ps or not 0 <= index < pool.size:
            raise ValueError(f"host index {index} is not the start of a page")
        if pool.layout == "layer_first":
            return buf[0, :, index:index + ps], buf[1, :, index:index + ps]
        if pool.layout == "page_first":
            return (buf[0, index:index + ps].transpose(0, 1),
                    buf[1, index:index + ps].transpose(0, 1))
        return buf[0, index // ps], buf[1, index // ps]

    def _require_pool(self) -> bytes:
        """This model's fingerprint, once the host pool is registered."""
        if self.mem_pool_host is None or self._fingerprint is None:
            raise RuntimeError("kvtier: register_mem_pool_host was not called")
        return self._fingerprint

    # ---- keys -----------------------------------------------------------------------------

    def kvtier_key(self, key: str) -> bytes:
        """The kvtier key of an SGLang key: 32 hex digits as they are, else the
        chunk key of the string's SHA-256 under this model's identity."""
        fingerprint = self._require_pool()
        if len(key) == 32:
            try:
                return bytes.fromhex(key)
            except ValueError:
                pass
        words = array.array("I", hashlib.sha256(key.encode()).digest())
        return kvtier.chunk_keys(fingerprint, words, len(words))[0]

    # ---- zero-copy batches ----------------------------------------------------------------

    def _host_pages(self, host_indices, n: int) -> list:
        """The HostPage of each of the n pages at ``host_indices[i * page_size]``."""
        self._require_pool()
        return [kvtier.HostPage.of(*self._page(int(host_indices[i * self.page_size])))
                for i in range(n)]

    def _batch(self, kind: str, keys: list[str], pages: list, misses: tuple = ()) -> list[bool]:
        """Moves every page of the batch between kvtierd and the host pool in
        one native call (``Client.get_pages`` for "prefetch", ``put_pages`` for
        "backup"), its pages on ``page_threads`` threads that hold no
        interpreter lock (SGLang's scheduler loop runs in this process: a
        page's steps done in Python would each wait for the lock), and records
        the batch in the StorageMetrics of ``kind``. A page that fails with one
        of ``misses`` is False (logged at debug level); any other kvtier
        failure is False, logged and counted in ``errors``."""
        self._require_pool()
        start = time.monotonic()
        if not keys:
            return []
        heads, dim = self.mem_pool_host.kv_buffer.shape[-2:]
        spec = kvtier.codec.ChunkSpec(self._require_pool(), self.layers, heads, dim,
                                      self.page_size, self.page_size,
                                      engine.DTYPE_NAMES[self.mem_pool_host.dtype],
                                      self.settings.codec)
        kv_keys = [self.kvtier_key(k) for k in keys]
        op = self.client.get_pages if kind == "prefetch" else self.client.put_pages
        result = op(spec, kv_keys, pages, threads=self.settings.page_threads)
        failed = 0
        for key, e in zip(keys, result.errors, strict=True):
            if e is None:
                continue
            if isinstance(e, misses):
                logger.debug("kvtier: %s of page %s failed: %s", kind, key, e)
            else:
                failed += 1
                logger.warning("kvtier: %s of page %s failed: %s", kind, key, e)
        results = [e is None for e in result.errors]
        with self._mu:
            self.errors += failed
            if kind == "backup":
                self._written.update(k for k, ok in zip(kv_keys, results, strict=True) if ok)
            self._metrics[f"{kind}_pgs"].append(sum(results))
            seconds = max(time.monotonic() - start, 1e-9)
            self._metrics[f"{kind}_bandwidth"].append(result.bytes / seconds / 1e9)
        return results

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Decodes page i of ``keys`` into the host page at ``host_indices[i * page_size]``.
        A missing, corrupt or foreign chunk is False (and kvtierd drops a corrupt one)."""
        return self._batch("prefetch", keys, self._host_pages(host_indices, len(keys)),
                           engine.UNUSABLE)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Encodes the host page at ``host_indices[i * page_size]`` and stores it as page i."""
        return self._batch("backup", keys, self._host_pages(host_indices, len(keys)))

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading keys kvtierd holds; 0 when it does not answer within lookup_timeout_ms."""
        if not keys:
            return 0
        plan = self.lookup.plan([self.kvtier_key(k) for k in keys], 0.0, self.page_size)
        return plan.hits if plan is not None else 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- flat pages (SGLang's generic path, without interface_v1) -------------------------

    def _flat_shape(self):
        pool = self.mem_pool_host
        heads, dim = pool.kv_buffer.shape[-2], pool.kv_buffer.shape[-1]
        if pool.layout == "layer_first":
            return (2, self.layers, self.page_size, heads, dim), (0, 1)
        if pool.layout == "page_first":
            return (2, self.page_size, self.layers, heads, dim), (1, 0)
        return (2, self.layers, self.page_size, heads, dim), (0, 1)

    def _flat_page(self, flat: torch.Tensor):
        """The HostPage of a flat page in the host pool's page order (a CPU
        tensor of the pool's dtype)."""
        if flat.device.type != "cpu" or flat.dtype != self.mem_pool_host.dtype:
            raise ValueError(f"kvtier: a flat page must be a CPU tensor of "
                             f"{self.mem_pool_host.dtype}, not {flat.device} {flat.dtype}")
        shape, order = self._flat_shape()
        page = flat.view(shape)
        return kvtier.HostPage.of(page[0].permute(*order, 2, 3), page[1].permute(*order, 2, 3))

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        """The page as a flat tensor in the host pool's page order (into
        ``target_location`` when given), or None on a miss or a bad chunk."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """get of every key, in one native call (as batch_get_v1)."""
        self._require_pool()
        shape, _ = self._flat_shape()
        numel = math.prod(shape)
        targets = list(target_locations) if target_locations else [
            torch.empty(numel, dtype=self.mem_pool_host.dtype) for _ in keys]
        ok = self._batch("prefetch", keys, [self._flat_page(t) for t in targets], engine.UNUSABLE)
        return [t if good else None for t, good in zip(targets, ok, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        """Stores a flat page (the host pool's page order) as ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None,
                  target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """set of every page, in one native call (as batch_set_v1); True if all
        were stored."""
        self._require_pool()
        flats = [v.detach().cpu().contiguous().view(-1) for v in values]
        return all(self._batch("backup", keys, [self._flat_page(f) for f in flats]))

    # ---- housekeeping ---------------------------------------------------------------------

    def clear(self) -> None:
        """Deletes the pages this backend stored (the cache is shared with other
        engines, whose chunks stay)."""
        with self._mu:
            written, self._written = self._written, set()
        for key in written:
            try:
                self.client.delete(key)
            except kvtier.NotFound:
                pass

    def get_stats(self):
        """SGLang's StorageMetrics since the last call (pages and GB/s per batch)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics
        with self._mu:
            metrics, self._metrics = self._metrics, {k: [] for k in self._metrics}
        return StorageMetrics(**metrics)

    def close(self) -> None:
        self.lookup.close()
        self.client.close()


__all__ = ["KvtierHiCacheStorage", "SGLANG_KEYS", "HOST_LAYOUTS"]

"""kvtier as a vLLM v1 KV connector: ``KvtierConnector``.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/run/kvtier/kvtierd.sock",
                                      "codec": "k16v8", "chunk_tokens": 256}}'

The extra config is ``kvtier.engine.ConnectorSettings`` (docs/engines.md).

Scheduler side: ``get_num_new_matched_tokens`` asks kvtierd, within
``lookup_timeout_ms``, for the load plan of the request's chunk keys and
answers with the chunks worth loading (a slow or dead kvtierd is a miss);
``update_state_after_alloc`` records which blocks those chunks go to;
``build_connector_meta`` hands a running request's computed prompt chunks
that kvtierd lacks to the workers (``save_while_running``), so they are
stored while it decodes; ``request_finished`` hands the rest of its full
chunks and keeps its blocks until the workers report every save of it done
(a request preempted with a save in flight waits in the workers'
``handle_preemptions``, before its blocks are written again); with
vLLM's KV events on, ``update_connector_output`` turns a save reported done
into a BlockStored event per chunk kvtierd holds, which ``take_events`` hands
to the scheduler's publisher.

Worker side: ``register_kv_caches`` takes vLLM's per-layer KV tensors: one
4-D tensor per layer, [blocks, kv_heads, block_size, 2 * head_dim] with K and
V side by side in the last dimension, in the memory order of vLLM's
KVCacheLayout (every backend of vLLM 0.26 and later; older ones' 5-D
FlashAttention / FlashInfer stacks and (K, V) pairs are taken too);
``bind_connector_metadata`` starts the step's saves on a background thread,
before the forward (their tokens were computed in earlier steps);
``start_load_kv`` loads the step's chunks (CPU tensors through the CPU codec;
CUDA tensors through kvtier's GPU load, which the compute stream waits for
before the forward, so vLLM keeps its full CUDA graphs; with the
``layerwise_load`` setting ``wait_for_layer_load`` waits per layer instead,
under piecewise graphs); ``get_finished`` reports finished saves and
``get_block_ids_with_load_errors`` the blocks of chunks that were missing or
corrupt, which vLLM then recomputes. In vLLM's sleep mode
(0.33+) ``unregister_kv_caches`` drains the loads and saves and drops the
pointers into the KV tensors, ``restore_kv_caches`` registers them again.

The tensor work is ``kvtier.engine.KvMover``; this module only adapts vLLM's
calls to it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvtier
from kvtier.integrations import engine
from kvtier.integrations.vllm_stats import KvtierConnectorStats, KvtierPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.vllm")

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


@dataclasses.dataclass
class ChunkJob:
    """Chunks of one request to load or save: ``keys[i]`` goes to or comes from
    ``block_ids[i]`` (the chunk's blocks, in token order). Under tensor
    parallelism ``keys`` are rank 0's and ``rank_keys[r - 1]`` rank r's: each
    rank stores its shard of the KV heads under keys of its own identity."""
    req_id: str
    keys: list
    block_ids: list
    rank_keys: list = dataclasses.field(default_factory=list)
    # A save of a request that is still running: its blocks stay its own, and
    # nothing is reported. A save with running False is the request's last
    # (it may have no chunks): the request's ``held_blocks`` blocks go back to
    # vLLM once it and every earlier save of the request are done.
    running: bool = False
    held_blocks: int = 0

    def keys_of(self, rank: int) -> list:
        return self.keys if rank == 0 else self.rank_keys[rank - 1]


@dataclasses.dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""
    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    # Requests preempted this step that have saves of their running chunks
    # (ChunkJob.running): the workers finish those before vLLM writes the
    # blocks again (handle_preemptions).
    preempted: list = dataclasses.field(default_factory=list)


# Keys the scheduler remembers as held by kvtierd (_held): 2 MiB of keys.
_HELD_KEYS = 1 << 16


@dataclasses.dataclass
class _Candidate:
    """A request's lookup: chunks [first_chunk, chunks) are to be loaded, the
    first ``hits`` are in kvtierd (and are not saved again); ``loading`` maps
    each chunk being loaded to its blocks."""
    first_chunk: int
    chunks: int
    hits: int
    keys: list
    loading: dict = dataclasses.field(default_factory=dict)
    tiers: list = dataclasses.field(default_factory=list)  # kvtierd's tier of each hit


@dataclasses.dataclass
class _SavedChunks:
    """A request's chunks handed to the workers to store, for the BlockStored
    events once the save is done: chunk ``first + i`` has key ``keys[i]``;
    ``block_hashes`` (vLLM's, as its KV events carry them) and ``token_ids``
    cover the request's blocks and tokens from token 0 to the last chunk."""
    first: int
    keys: list
    block_hashes: list
    token_ids: list
    lora_id: int | None
    lora_name: str | None


@dataclasses.dataclass
class _Running:
    """A request saved while it runs (``save_while_running``): vLLM's Request,
    its blocks as the workers have them (vLLM's scheduler output, followed
    step by step), and its prompt's chunks handled so far: [0, done) are held
    by kvtierd or were handed to the workers, [first_saved, done) of them to
    be saved. ``done`` is None until a chunk was computed."""
    request: Any
    block_ids: list = dataclasses.field(default_factory=list)
    keys: list = dataclasses.field(default_factory=list)
    done: int | None = None
    first_saved: int | None = None


def _block_stored(**fields: Any):
    """vLLM's BlockStored event with the fields this vLLM has (vLLM 0.26-0.33
    add optional fields; one it lacks is left out)."""
    from vllm.distributed.kv_events import BlockStored
    have = set(BlockStored.__struct_fields__)
    return BlockStored(**{k: v for k, v in fields.items() if k in have})


def _model_dtype(vllm_config: VllmConfig) -> torch.dtype:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto" and cache_dtype not in _TORCH_DTYPES:
        raise ValueError(f"kvtier caches 16-bit KV; --kv-cache-dtype {cache_dtype} is not "
                         "supported (use auto with a bfloat16/float16 model)")
    dtype = _TORCH_DTYPES.get(cache_dtype) or vllm_config.model_config.dtype
    if isinstance(dtype, str):
        dtype = _TORCH_DTYPES.get(dtype, dtype)
    if dtype not in engine.DTYPE_NAMES:
        raise ValueError(f"kvtier caches BF16/FP16 KV, not {dtype}; pass --dtype bfloat16")
    return dtype


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector over kvtierd (see the module comment)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.settings = engine.ConnectorSettings.from_mapping(extra)
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail" and \
                role == KVConnectorRole.SCHEDULER:
            logger.warning("kvtier: kv_load_failure_policy is 'fail': a chunk kvtierd lost or "
                           "found corrupt between lookup and load fails its request instead of "
                           "being recomputed. kvtier is a cache; 'recompute' is the safe policy.")
        if getattr(vllm_config.model_config, "use_mla", False):
            # Its cache holds one latent vector per token, no K and V per head.
            raise ValueError("kvtier stores K and V per head; MLA models (a latent KV, as "
                             "DeepSeek-V2/V3) are not supported")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                "kvtier caches models whose layers share one KV cache group (full attention); "
                f"this model has {len(groups)} groups (a hybrid model). Pass "
                "--disable-hybrid-kv-cache-manager so every layer keeps full KV.")
        # A pipeline stage holds other layers under the same chunk keys and
        # fingerprint (a stage would load another's layers as its own); a
        # context-parallel rank holds an interleaved share of each block's
        # tokens, which a chunk (tokens in order) does not describe.
        layers = "its stages hold other layers under the same chunk keys"
        tokens = "its ranks hold interleaved shares of each block's tokens"
        for field, flag, why in (
                ("pipeline_parallel_size", "--pipeline-parallel-size", layers),
                ("decode_context_parallel_size", "--decode-context-parallel-size", tokens),
                ("prefill_context_parallel_size", "--prefill-context-parallel-size", tokens)):
            size = int(getattr(vllm_config.parallel_config, field, 1) or 1)
            if size > 1:
                raise ValueError(
                    f"kvtier does not support {field} {size}: {why}. Run with {flag} 1 "
                    "(tensor parallelism is supported).")
        self.block_size = int(vllm_config.cache_config.block_size)
        self.head_size = int(vllm_config.model_config.get_head_size())
        if self.settings.chunk_tokens % self.block_size:
            raise ValueError(f"kvtier: chunk_tokens {self.settings.chunk_tokens} must be a "
                             f"multiple of vLLM's block size {self.block_size} (--block-size)")
        self.chunk_tokens = self.settings.chunk_tokens
        # The plan's attention term: the setting, else C2 of the model's config.
        model_config = vllm_config.model_config
        hf_config = getattr(model_config, "hf_text_config", None) or \
            getattr(model_config, "hf_config", None)
        self.attention_doubling_tokens = engine.resolve_attention_doubling_tokens(
            self.settings.attention_doubling_tokens, hf_config)
        # The plan's rate: the setting, else (measure_prefill_rate) the engine's own.
        self._prefill_meter = (
            engine.PrefillRateMeter(self.attention_doubling_tokens, min_tokens=self.chunk_tokens)
            if self.settings.measure_prefill_rate and self.settings.prefill_tokens_per_s == 0
            else None)
        # kv_role: kv_both loads and saves, kv_consumer only loads, kv_producer only saves.
        self.loads = bool(self._kv_transfer_config.is_kv_consumer)
        self.saves = bool(self._kv_transfer_config.is_kv_producer)
        model_id = self.settings.model_id or vllm_config.model_config.model
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._identity_args: dict[str, Any] = dict(
            model_id=model_id, dtype=_model_dtype(vllm_config), codec=self.settings.codec,
            revision=self.settings.revision, tp_world_size=self.tp_size)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvtier is a cache; a save lost to a preemption is a later miss."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        """True with the ``layerwise_load`` setting: wait_for_layer_load then makes
        the compute stream wait for each layer's load, a call between the layers'
        kernels that a full CUDA graph would skip. Without it (the default) the
        forward waits for the whole load before it starts and vLLM keeps its full
        CUDA graphs: piecewise ones cost every decode step (about 4-7 ms a step
        for Llama-3.1-8B on an H200, bench/results/vllm-gpu.md)."""
        return (extra_config or {}).get("layerwise_load") is True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """True (vLLM 0.33+ asks before it allows --enable-sleep-mode): the
        workers follow the KV cache through unregister_kv_caches and
        restore_kv_caches."""
        return True

    # ==== scheduler side ===============================================================

    def _init_scheduler(self) -> None:
        # The scheduler asks about tensor-parallel rank 0's chunks; a chunk another
        # rank lacks is a load error on that rank and is recomputed.
        self.identity = engine.engine_identity(tp_rank=0, **self._identity_args)
        self._fingerprint = self.identity.fingerprint()
        self._rank_fingerprints = [
            engine.engine_identity(tp_rank=r, **self._identity_args).fingerprint()
            for r in range(1, self.tp_size)]
        self.lookup = engine.BoundedLookup(self.settings.connect, self.settings.lookup_timeout_ms,
                                           self.settings.retry_after_ms)
        self._candidates: dict[str, _Candidate] = {}
        self._loads: list = []
        self._saves: list = []
        # Keys kvtierd held at a lookup (True) or that this scheduler sent to be
        # saved (False: the save may have failed or been skipped), newest last:
        # a request whose prefix vLLM's own GPU cache served (no lookup) does
        # not store those chunks again.
        self._held: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        # Keys of saves not yet reported done, by request, and how many such
        # saves name each key: not stored twice while a save is in flight.
        self._saving_keys: dict[str, list[bytes]] = {}
        self._in_flight: collections.Counter[bytes] = collections.Counter()
        # KV events (vLLM's --kv-events-config): a BlockStored per chunk kvtierd
        # holds once its request's save is done.
        events_config = getattr(self._vllm_config, "kv_events_config", None)
        self._emit_events = bool(getattr(events_config, "enable_kv_cache_events", False))
        self._saving: dict[str, _SavedChunks] = {}
        self._events: list = []
        # Requests saved while they run, from their allocation to request_finished.
        self._running: dict[str, _Running] = {}
        self._save_running = self.saves and self.settings.save_while_running

    def _keys(self, token_ids) -> list:
        tokens = engine.token_array(token_ids)
        return kvtier.chunk_keys(self._fingerprint, tokens, self.chunk_tokens) if tokens else []

    def _rank_keys(self, request: Request, chunks: range) -> list:
        """The keys of ``chunks`` of ``request`` for tensor-parallel ranks 1 and up."""
        if not self._rank_fingerprints or not chunks:
            return []
        tokens = engine.token_array(list(request.all_token_ids)[:chunks.stop * self.chunk_tokens])
        return [kvtier.chunk_keys(fp, tokens, self.chunk_tokens)[chunks.start:chunks.stop]
                for fp in self._rank_fingerprints]

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` to load: whole chunks from kvtierd's
        plan, starting at a chunk boundary. A local hit that ends inside a chunk
        loads nothing (the chunk's first tokens are already in shared blocks)."""
        self._candidates.pop(request.request_id, None)
        if not self.loads or num_computed_tokens % self.chunk_tokens:
            return 0, False
        tokens = list(request.all_token_ids)
        max_chunks = (len(tokens) - 1) // self.chunk_tokens
        first = num_computed_tokens // self.chunk_tokens
        if max_chunks <= first:
            return 0, False
        keys = self._keys(tokens[:max_chunks * self.chunk_tokens])
        rate = self.prefill_tokens_per_s()
        plan = self.lookup.plan(keys, rate, self.chunk_tokens, self.attention_doubling_tokens)
        chunks = engine.loadable_chunks(plan, self.settings, len(tokens), rate)
        hits = plan.hits if plan is not None else 0
        self._candidates[request.request_id] = _Candidate(
            first, chunks, hits, keys, tiers=list(plan.tiers) if plan is not None else [])
        if chunks <= first:
            return 0, False
        return (chunks - first) * self.chunk_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self._save_running:
            self._running.setdefault(request.request_id, _Running(request))
        cand = self._candidates.get(request.request_id)
        if num_external_tokens <= 0 or cand is None:
            return
        block_ids = blocks.get_block_ids()[0]
        per = self.chunk_tokens // self.block_size
        last = cand.first_chunk + num_external_tokens // self.chunk_tokens
        chunks = range(cand.first_chunk, last)
        cand.loading = {c: list(block_ids[c * per:(c + 1) * per]) for c in chunks}
        self._loads.append(ChunkJob(request.request_id, [cand.keys[c] for c in chunks],
                                    list(cand.loading.values()),
                                    self._rank_keys(request, chunks)))

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict:
        """The loaded tokens by the kvtierd tier they come from (vLLM 0.32+):
        DRAM as host, NVMe as disk, a peer node as p2p, kvtierd's HBM as device."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
        if num_external_tokens <= 0:
            return {}
        cand = self._candidates.get(request.request_id)
        sources: dict[str | None, Any] = {
            "hbm": CacheHitSource.DEVICE, "dram": CacheHitSource.HOST,
            "nvme": CacheHitSource.DISK, "remote": CacheHitSource.P2P}
        counts: dict = {}
        chunks = num_external_tokens // self.chunk_tokens
        if cand is not None:
            for c in range(cand.first_chunk, cand.first_chunk + chunks):
                tier = cand.tiers[c] if c < len(cand.tiers) else None
                source = sources.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
                counts[source] = counts.get(source, 0) + self.chunk_tokens
        rest = num_external_tokens - sum(counts.values())
        if rest:
            counts[CacheHitSource.EXTERNAL_UNSPECIFIED] = \
                counts.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + rest
        return counts

    def update_connector_output(self, connector_output) -> None:
        """A request in ``finished_sending`` has its save done: the chunks of it
        kvtierd holds become BlockStored events (with KV events on). A chunk
        that failed to load is no longer counted as held by kvtierd (it was
        missing or corrupt, and kvtierd dropped it), so the request saves it
        again when it finishes."""
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            for key in self._saving_keys.pop(req_id, ()):
                self._in_flight[key] -= 1
                if self._in_flight[key] <= 0:
                    del self._in_flight[key]
            saved = self._saving.pop(req_id, None)
            if saved is not None:
                self._events.extend(self._stored_events(saved))
        bad = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not bad:
            return
        for req_id, cand in self._candidates.items():
            failed = [c for c, ids in cand.loading.items() if bad.intersection(ids)]
            if failed:
                cand.hits = min(cand.hits, min(failed))
                for c in failed:
                    self._held.pop(bytes(cand.keys[c]), None)
                run = self._running.get(req_id)
                if run is not None and run.done is not None and run.first_saved is None:
                    run.done = min(run.done, cand.hits)  # recomputed, then saved

    def _remember_held(self, keys: Sequence, confirmed: bool) -> None:
        """Remembers ``keys`` as held (``confirmed``: kvtierd said so) or as sent
        to be saved, newest last, within _HELD_KEYS."""
        for key in map(bytes, keys):
            self._held[key] = confirmed or self._held.get(key, False)
            self._held.move_to_end(key)
        while len(self._held) > _HELD_KEYS:
            self._held.popitem(last=False)

    def _held_prefix(self, keys: list) -> int:
        """How many leading ``keys`` kvtierd holds: those it said it holds or
        whose save is in flight, then kvtierd's answer for the rest (a bounded
        lookup; a lookup that fails counts as a miss, so the chunks are
        saved). A chunk sent to be saved whose save is done is asked about: the
        save may have failed or been skipped."""
        known = 0
        while known < len(keys) and (self._held.get(bytes(keys[known])) or
                                     bytes(keys[known]) in self._in_flight):
            known += 1
        if known == len(keys):
            return known
        plan = self.lookup.plan(keys[known:], 0.0, self.chunk_tokens)
        hits = plan.hits if plan is not None else 0
        self._remember_held(keys[known:known + hits], True)
        if plan is not None:
            for key in map(bytes, keys[known + hits:]):
                self._held.pop(key, None)
        return known + hits

    def prefill_tokens_per_s(self) -> float:
        """The rate the plan prices recompute at: the setting, else the measured
        one (0, every hit loaded, until measured or without measuring)."""
        if self._prefill_meter is not None:
            return self._prefill_meter.rate()
        return self.settings.prefill_tokens_per_s

    @staticmethod
    def _step_spans(scheduler_output: SchedulerOutput) -> list:
        """(first context position, tokens) of each request the step runs."""
        num = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        spans = [(r.num_computed_tokens, num.get(r.req_id, 0))
                 for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ()]
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            spans += [(c, num.get(rid, 0)) for rid, c in
                      zip(getattr(cached, "req_ids", ()),
                          getattr(cached, "num_computed_tokens", ()), strict=False)]
        return spans

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._prefill_meter is not None:
            self._prefill_meter.step(self._step_spans(scheduler_output))
        preempted = self._follow_running(scheduler_output) if self._running else []
        meta = KvtierConnectorMetadata(loads=self._loads, saves=self._saves, preempted=preempted)
        self._loads, self._saves = [], []
        return meta

    def _follow_running(self, scheduler_output: SchedulerOutput) -> list:
        """Follows the blocks of the requests saved while they run (as vLLM's
        runner does: a new request's blocks, then each step's new ones, replaced
        on resumption), hands the prompt chunks they computed in earlier steps
        to the workers, and returns those preempted by this step that have
        saves, which the workers finish before vLLM writes their blocks again."""
        scheduled = []
        for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            run = self._running.get(req.req_id)
            if run is not None:
                run.block_ids = list(req.block_ids[0]) if req.block_ids else []
                scheduled.append(run)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", None)
            if resumed is None:  # vLLM before 0.26: a flag per request
                resumed = {r for r, flag in zip(
                    cached.req_ids, getattr(cached, "resumed_from_preemption", ()),
                    strict=False) if flag}
            for req_id, new in zip(cached.req_ids, cached.new_block_ids, strict=False):
                run = self._running.get(req_id)
                if run is None:
                    continue
                if req_id in resumed:
                    run.block_ids = list(new[0]) if new else []
                elif new:
                    run.block_ids.extend(new[0])
                scheduled.append(run)
        for run in scheduled:
            self._save_computed(run)
        return [r for r in getattr(scheduler_output, "preempted_req_ids", None) or ()
                if r in self._running and self._running[r].first_saved is not None]

    def _save_computed(self, run: _Running) -> None:
        """Hands the prompt chunks of ``run`` whose tokens earlier steps computed
        (num_computed_tokens before this step's) and kvtierd lacks to the
        workers; the chunks a lookup found, or kvtierd holds, are skipped."""
        request = run.request
        prompt = int(request.num_prompt_tokens)
        computed = min(int(request.num_computed_tokens), prompt,
                       len(run.block_ids) * self.block_size)
        full = computed // self.chunk_tokens
        if full == 0 or (run.done is not None and full <= run.done):
            return
        cand = self._candidates.get(request.request_id)
        if len(run.keys) < full:
            n = prompt // self.chunk_tokens
            run.keys = cand.keys[:n] if cand is not None and len(cand.keys) >= n \
                else self._keys(list(request.all_token_ids)[:n * self.chunk_tokens])
        done = run.done or 0
        if run.first_saved is None:
            if cand is None:
                # No lookup ran (vLLM's GPU prefix cache covered every chunk
                # boundary, or this role only saves): store only what kvtierd lacks.
                done += self._held_prefix(run.keys[done:full])
            elif run.done is None:
                done = cand.hits  # the lookup's misses follow its hits
                self._remember_held(run.keys[:done], True)
            run.done = done
            if full <= done:
                return
            run.first_saved = done
        self._hand_saves(request, range(done, full), run.keys, run.block_ids, running=True)
        run.done = full

    def _hand_saves(self, request: Request, chunks: range, keys: list, block_ids: Sequence,
                    running: bool, held_blocks: int = 0) -> None:
        """Hands chunks ``chunks`` of ``request`` (chunk c: key ``keys[c]``, the
        blocks of its tokens among ``block_ids``) to the workers to save."""
        saving = [bytes(keys[c]) for c in chunks]
        self._remember_held(saving, False)
        self._saving_keys.setdefault(request.request_id, []).extend(saving)
        self._in_flight.update(saving)
        per = self.chunk_tokens // self.block_size
        self._saves.append(ChunkJob(request.request_id, [keys[c] for c in chunks],
                                    [list(block_ids[c * per:(c + 1) * per]) for c in chunks],
                                    self._rank_keys(request, chunks), running=running,
                                    held_blocks=held_blocks))

    def request_finished(self, request: Request,
                         block_ids: Sequence) -> tuple[bool, dict[str, Any] | None]:
        """Saves the request's full chunks that kvtierd does not hold and were not
        saved while it ran; returns True (keep the blocks) until the workers
        report every save of the request done."""
        cand = self._candidates.pop(request.request_id, None)
        run = self._running.pop(request.request_id, None)
        if not self.saves:
            return False, None
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            block_ids = block_ids[0]
        computed = min(int(request.num_computed_tokens), len(block_ids) * self.block_size)
        full = computed // self.chunk_tokens
        handled = run.done if run is not None else None  # chunks handled while it ran
        saved_from = run.first_saved if run is not None else None  # the first it saved
        if handled is None and full <= (cand.hits if cand is not None else 0):
            return False, None
        end = max(full, handled or 0)
        if run is not None and len(run.keys) >= end:
            keys = run.keys[:end]
        elif cand is not None and len(cand.keys) >= end:
            keys = cand.keys[:end]  # the lookup's: the same prompt's first chunks
        else:
            keys = self._keys(list(request.all_token_ids)[:end * self.chunk_tokens])
        if handled is None and cand is not None:
            first = cand.hits
            self._remember_held(keys[:first], True)
        else:
            first = handled or 0
            if cand is None and saved_from is None and first < full:
                # No lookup ran (vLLM's GPU prefix cache covered every chunk
                # boundary, or this role only saves): store only what kvtierd lacks.
                first += self._held_prefix(keys[first:full])
        if full <= first and saved_from is None:
            return False, None
        # The last save, with no chunks when the running saves covered them: the
        # workers report it once every save of the request is done.
        self._hand_saves(request, range(first, max(first, full)), keys, block_ids,
                         running=False, held_blocks=len(block_ids))
        if self._emit_events:
            start = saved_from if saved_from is not None else first
            saved = self._saved_chunks(request, start, keys[start:max(first, full)])
            if saved is not None:
                self._saving[request.request_id] = saved
        return True, None

    def _saved_chunks(self, request: Request, first: int, keys: list) -> _SavedChunks | None:
        """What the BlockStored events of the request's saved chunks name, or
        None when vLLM hashes no blocks of it (prefix caching off) or hashes
        them at another granularity than the block (a hybrid layout)."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        hashes = list(getattr(request, "block_hashes", None) or ())
        tokens = list(request.all_token_ids)
        end = first + len(keys)
        blocks = end * self.chunk_tokens // self.block_size
        if not blocks <= len(hashes) <= len(tokens) // self.block_size:
            return None
        lora = getattr(request, "lora_request", None)
        return _SavedChunks(first, keys, [maybe_convert_block_hash(h) for h in hashes[:blocks]],
                            tokens[:end * self.chunk_tokens],
                            lora.adapter_id if lora is not None else None,
                            lora.name if lora is not None else None)

    def _stored_events(self, saved: _SavedChunks) -> list:
        """A BlockStored per saved chunk that kvtierd holds (asked within
        lookup_timeout_ms; a failed or skipped save, or a lookup that fails,
        publishes nothing), its medium ``kvtier:<tier>``."""
        plan = self.lookup.plan(saved.keys, 0.0, self.chunk_tokens)
        if plan is None:
            return []
        per = self.chunk_tokens // self.block_size
        events = []
        for i in range(min(plan.hits, len(saved.keys))):
            c = saved.first + i
            b = c * per
            events.append(_block_stored(
                block_hashes=saved.block_hashes[b:b + per],
                parent_block_hash=saved.block_hashes[b - 1] if b else None,
                token_ids=saved.token_ids[c * self.chunk_tokens:(c + 1) * self.chunk_tokens],
                block_size=self.block_size, lora_id=saved.lora_id, lora_name=saved.lora_name,
                medium=f"kvtier:{plan.tiers[i]}", group_idx=0))
        return events

    def take_events(self) -> Iterable:
        """The BlockStored events of saves done since the last call (vLLM's
        scheduler publishes them with its own KV events). kvtierd's evictions
        are not reported: no BlockRemoved."""
        if self._role != KVConnectorRole.SCHEDULER:
            return ()
        events, self._events = self._events, []
        return events

    # ==== worker side ==================================================================

    def _init_worker(self) -> None:
        tp_rank = 0
        if self.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            tp_rank = get_tensor_model_parallel_rank()
        self.tp_rank = tp_rank
        self.identity = engine.engine_identity(tp_rank=tp_rank, **self._identity_args)
        self.mover: engine.KvMover | None = None
        self._kv_caches: dict | None = None  # vLLM's tensors, kept for restore_kv_caches
        self._client: kvtier.Client | None = None
        self._layer_index: dict = {}
        self._pending_loads: list = []  # (ChunkJob, PendingLoad)
        self._failed_blocks: set = set()
        self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        self._mu = threading.Lock()
        self._saved: set = set()
        self._finished: set = set()  # finished requests vLLM told get_finished about
        self._pending_save_chunks = 0  # guarded by _mu
        # Saves handed to the saver and not done, by request; and the requests
        # whose last save was handed over: when it was, and the blocks vLLM keeps
        # for them until no save of theirs is left (both guarded by _mu).
        self._jobs_of: collections.Counter[str] = collections.Counter()
        self._finishing: dict[str, tuple[float, int]] = {}
        self._saves_idle = threading.Condition(self._mu)  # a save is done
        # Counts (vllm_stats.COUNTERS) of this interval and since the start; _count.
        self._stats = KvtierConnectorStats()  # guarded by _mu
        self._totals = KvtierConnectorStats()  # guarded by _mu
        self._save_stream: torch.cuda.Stream | None = None  # CUDA: the saver's own stream

    def _count(self, **counts: float) -> None:
        """Adds to this interval's counts and the totals. REQUIRES: _mu held."""
        for name, value in counts.items():
            self._stats.add(name, value)
            self._totals.add(name, value)

    @property
    def save_errors(self) -> int:
        """Requests whose store failed, since the start."""
        with self._mu:
            return int(self._totals.data["store_errors"])

    @property
    def load_errors(self) -> int:
        """Chunks that failed to load (and were recomputed), since the start."""
        with self._mu:
            return int(self._totals.data["load_errors"])

    @property
    def saves_skipped(self) -> int:
        """Chunks not stored because the save queue was full, since the start."""
        with self._mu:
            return int(self._totals.data["chunks_store_skipped"])

    def register_kv_caches(self, kv_caches: dict) -> None:
        names = list(kv_caches)
        kv = engine.PagedKv([kv_caches[n] for n in names], self.settings.kv_cache_layout,
                            head_dim=self.head_size)
        if kv.block_size != self.block_size:
            raise ValueError(f"kvtier: the KV cache's block size {kv.block_size} is not the "
                             f"configured {self.block_size}")
        self._layer_index = {n: i for i, n in enumerate(names)}
        if self._client is None:
            self._client = self.settings.connect()
        self.mover = engine.KvMover(self._client, kv, self.identity, self.chunk_tokens)
        if self.mover.on_gpu:
            kv.gpu_cache()
        self._kv_caches = dict(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM sleep mode (0.33+), before the KV cache's memory is released:
        finishes the step's loads, stores every queued save (waiting for them),
        then drops the mover and with it every pointer into the KV tensors.
        Idempotent; restore_kv_caches undoes it."""
        mover = self.mover
        if mover is None:
            return
        self._finish_loads()
        # The blocks of failed loads belong to requests that vLLM's pause
        # finished or preempted; after the wake-up these ids name other KV.
        self._failed_blocks = set()
        with self._saves_idle:
            self._saves_idle.wait_for(lambda: self._pending_save_chunks == 0)
        if mover.on_gpu:
            torch.cuda.synchronize(mover.kv.device)
        self.mover = None
        mover.kv.close()

    def restore_kv_caches(self) -> None:
        """vLLM sleep mode (0.33+), after the KV cache is mapped again (at the
        same addresses; its old contents are gone): registers vLLM's KV tensors
        anew. Idempotent."""
        if self.mover is None and self._kv_caches is not None:
            self.register_kv_caches(self._kv_caches)

    def _mover(self) -> engine.KvMover:
        if self.mover is None:
            if self._kv_caches is not None:
                raise RuntimeError("kvtier: the KV caches are unregistered (vLLM sleep mode); "
                                   "restore_kv_caches was not called")
            raise RuntimeError("kvtier: register_kv_caches was not called")
        return self.mover

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        layers = len(self._layer_index)
        layerwise = self.settings.layerwise_load
        for job in meta.loads:
            pending = self._mover().load(job.keys_of(self.tp_rank), job.block_ids,
                                         self.settings.layer_group if layerwise else layers)
            if not layerwise and layers:
                # The compute stream (which also replays full CUDA graphs) waits on
                # the device for the whole load, before the forward's first kernel.
                pending.wait_layer(layers - 1)
            self._pending_loads.append((job, pending))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self.settings.layerwise_load:
            return  # start_load_kv made the forward wait for the whole load
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for _, pending in self._pending_loads:
            pending.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to do per layer: a request's chunks are saved from its blocks
        when it finishes (request_finished), which vLLM keeps until then."""

    def _finish_loads(self) -> None:
        for job, pending in self._pending_loads:
            result = pending.finish()
            with self._mu:
                self._count(chunks_loaded=len(job.keys) - len(result.failed),
                            load_errors=len(result.failed))
            for i in result.failed:
                logger.warning("kvtier: chunk %s of request %s not loaded (%s); recomputing",
                               kvtier.key_hex(job.keys_of(self.tp_rank)[i]), job.req_id,
                               result.errors[i])
                self._failed_blocks.update(job.block_ids[i])
        self._pending_loads = []

    def _save_job(self, job: ChunkJob, ready) -> None:
        stream = self._save_stream
        start = time.perf_counter()
        stored = failed = 0
        try:
            if ready is not None and stream is not None:
                # The blocks hold this step's KV once the compute stream passed `ready`;
                # the encode runs on the saver's stream, beside the next forwards.
                stream.wait_event(ready)
            errors = self._mover().save_many(job.keys_of(self.tp_rank), job.block_ids,
                                             stream=stream)
            stored = sum(e is None for e in errors)
            bad = next((e for e in errors if e is not None), None)
            if bad is not None:
                failed = 1
                logger.warning("kvtier: saving request %s failed for %d of its %d chunks: %s",
                               job.req_id, len(errors) - stored, len(errors), bad)
        except (kvtier.KvtierError, ValueError) as e:
            failed = 1
            logger.warning("kvtier: saving request %s failed: %s", job.req_id, e)
        finally:
            with self._mu:
                self._pending_save_chunks -= len(job.keys)
                self._jobs_of[job.req_id] -= 1
                end = time.perf_counter()
                self._count(chunks_stored=stored, store_errors=failed, store_seconds=end - start)
                self._settle(job.req_id, end)
                self._saves_idle.notify_all()

    def _settle(self, req_id: str, now: float) -> None:
        """Reports ``req_id``'s saves done (get_finished) once its last save was
        handed over and none of its saves is left. REQUIRES: _mu held."""
        if self._jobs_of[req_id] > 0:
            return
        del self._jobs_of[req_id]
        finishing = self._finishing.pop(req_id, None)
        if finishing is not None:
            self._saved.add(req_id)
            submitted, blocks = finishing
            self._count(store_block_seconds=blocks * (now - submitted))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Binds the step's metadata and hands its saves to the saver at once,
        before the step's forward (every runner binds first): a save is of a
        finished request whose KV the earlier steps wrote, so its encode waits
        only for the work enqueued so far, not for this step's forward. (Saves
        submitted after the forward waited for it, the next request's whole
        prefill, and then ran beside its decode steps.)"""
        if self.mover is None and (getattr(connector_metadata, "loads", None)
                                   or getattr(connector_metadata, "saves", None)):
            self._mover()  # raises: not registered, or unregistered for sleep mode
        super().bind_connector_metadata(connector_metadata)
        self._submit_saves(connector_metadata)

    def wait_for_save(self) -> None:
        self._finish_loads()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls this before a step's forward: a request preempted by the
        step may have saves of its running chunks that still read its blocks,
        which the step may give to another request. Waits for those saves (rare:
        a preemption while the request's prompt is being stored)."""
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if not preempted:
            return
        with self._saves_idle:
            self._saves_idle.wait_for(lambda: not any(self._jobs_of[r] for r in preempted))

    def _submit_saves(self, meta: KVConnectorMetadata) -> None:
        """Hands the saves of `meta` to the saver thread; the blocks hold their KV
        once the compute stream passes what was enqueued before this call."""
        saves = getattr(meta, "saves", None) or ()
        ready = None
        if saves and self._mover().on_gpu:
            device = self._mover().kv.device
            if self._save_stream is None:
                self._save_stream = torch.cuda.Stream(device=device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        limit = self.settings.max_pending_save_chunks
        for job in saves:
            now = time.perf_counter()
            with self._mu:
                skip = self._pending_save_chunks + len(job.keys) > limit
                if skip:
                    # Never queue without bound: these chunks are not stored (a
                    # later miss), and a finished request's blocks go back as soon
                    # as its earlier saves are done.
                    self._count(chunks_store_skipped=len(job.keys))
                elif job.keys:
                    self._pending_save_chunks += len(job.keys)
                    self._jobs_of[job.req_id] += 1
                if not job.running:
                    self._finishing[job.req_id] = (now, job.held_blocks)
                    self._settle(job.req_id, now)
            if skip and job.keys:
                logger.debug("kvtier: save queue full; %d chunks of request %s not stored",
                             len(job.keys), job.req_id)
            if skip or not job.keys:
                continue
            self._saver.submit(self._save_job, job, ready)

    def get_finished(self, finished_req_ids: set) -> tuple[set | None, set | None]:
        # A save is reported once vLLM has named its request as finished.
        with self._mu:
            self._finished |= set(finished_req_ids)
            done = self._saved & self._finished
            self._saved -= done
            self._finished -= done
        return (done or None), None

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        """This worker's counts of the interval (vLLM's KV transfer metrics), then a
        new interval; the scheduler side counts nothing."""
        if self._role == KVConnectorRole.SCHEDULER:
            return None
        with self._mu:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvtierConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvtierConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set:
        self._finish_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self.lookup.close()
            return
        self._saver.shutdown(wait=True)
        if self._client is not None:
            self._client.close()


__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "ChunkJob"]

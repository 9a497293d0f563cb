"""kvtier.vllm.KvtierConnector inside vLLM's own v1 scheduler, against a real
kvtierd, on the CPU (no model runs: the test plays the model runner, as
vLLM's connector unit tests do). The worker side moves real CPU tensors
through the CPU codec.

Runs in the engines venv (scripts/python-venv with requirements-vllm.txt),
where vLLM is installed; the model config is a tiny Llama config.json in a
temp dir (no network)."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import transformers
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVEventsConfig, KVTransferConfig,
                         ModelConfig, SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

try:  # vLLM 0.33 plans the KV cache in its own module
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

import kvtier
from conftest import Daemon, corrupt_in_pool, eventually
from kvtier import engine
from kvtier.vllm import ChunkJob, KvtierConnector, KvtierConnectorMetadata

LAYERS, HEADS, DIM = 2, 2, 16
BLOCK, CHUNK = 16, 32
NUM_BLOCKS = 64
EOS = 255


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama config.json (vLLM reads the model's geometry from it)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaConfig(vocab_size=256, hidden_size=HEADS * DIM * 2, intermediate_size=64,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS * 2,
                             num_key_value_heads=HEADS, head_dim=DIM,
                             max_position_embeddings=4096, torch_dtype="bfloat16",
                             eos_token_id=EOS).save_pretrained(path)
    return str(path)


def vllm_config(model_dir: str, extra: dict, kv_role: str = "kv_both", kv_events: bool = False,
                **cache) -> VllmConfig:
    model = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                        dtype="bfloat16", seed=0)
    return VllmConfig(
        kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null"),
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True, **cache),
        kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                            kv_connector_module_path="kvtier.vllm",
                                            kv_role=kv_role, kv_connector_extra_config=extra,
                                            kv_load_failure_policy="recompute"),
        device_config=DeviceConfig("cpu"))


def kv_cache_config(groups: int = 1, heads: int = HEADS) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=DIM,
                             dtype=torch.bfloat16)
    group_list = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                                   spec)]
    if groups > 1:
        group_list.append(KVCacheGroupSpec(["model.layers.9.self_attn.attn"],
                                           SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS,
                                                             head_size=DIM, dtype=torch.bfloat16,
                                                             sliding_window=64)))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=group_list)


_HASH_READY = []


def make_request(req_id: str, tokens: list, max_tokens: int = 1) -> Request:
    from vllm.utils.hashing import sha256
    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY.append(True)
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def vllm_kv_caches(config: VllmConfig, layout: str, heads: int = HEADS):
    """(KVCacheConfig, per-layer KV tensors) as vLLM's own engine core and
    worker make them for ``layout`` (a KVCacheLayout name): the KV cache config
    from the groups (vLLM's placement of layers and blocks), then the worker's
    allocation, whose per-layer [blocks, kv_heads, block_size, 2 * head_dim]
    views are what a connector's register_kv_caches gets."""
    config.cache_config.kv_cache_layout = layout
    groups = kv_cache_config(heads=heads).kv_cache_groups
    page = groups[0].kv_cache_spec.page_size_bytes
    kvc = get_kv_cache_config_from_groups(config, groups, NUM_BLOCKS * LAYERS * page)
    assert kvc.num_blocks == NUM_BLOCKS
    return kvc, allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[layout])


class Engine:
    """vLLM's scheduler plus one worker-side connector over CPU KV tensors that
    vLLM's own allocator made: ``step()`` schedules, runs the worker's
    connector calls in the order of vLLM's runner around a "forward" that
    writes seeded KV into the scheduled tokens' blocks, and feeds the result
    back to the scheduler. ``runner`` "0.31": wait_for_save on every step;
    "0.26": none on a step that runs no tokens (vLLM 0.26-0.30). ``tp`` > 1:
    one worker per tensor-parallel rank, each with its share of the KV heads
    and its rank as vLLM's parallel state gives it, every worker call made on
    each rank and their outputs combined as vLLM's executor does (a request's
    transfer is finished once every rank reports it). ``decode_writes``: the
    forward writes the blocks of every scheduled token (running requests'
    too), not only those of the requests it prefills."""

    def __init__(self, model_dir: str, extra: dict, seed: int = 0, layout="LBNHC",
                 kv_role: str = "kv_both", runner: str = "0.31", kv_events: bool = False,
                 tp: int = 1, decode_writes: bool = False):
        self.config = vllm_config(model_dir, extra, kv_role, kv_events)
        self.config.parallel_config.tensor_parallel_size = tp
        kvc, self.caches = vllm_kv_caches(self.config, layout, heads=HEADS // tp)
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.runner = runner
        self.decode_writes = decode_writes
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kvc, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK)
        self.workers, self.rank_caches = [], [self.caches]
        for rank in range(tp):
            if rank > 0:
                self.rank_caches.append(vllm_kv_caches(self.config, layout, heads=HEADS // tp)[1])
            with _tp_rank(rank):
                self.workers.append(KvtierConnector(self.config, KVConnectorRole.WORKER, kvc))
            self.workers[-1].register_kv_caches(self.rank_caches[-1])
        self.worker = self.workers[0]
        g = torch.Generator().manual_seed(seed)
        self.kvs = [w.mover.kv for w in self.workers]
        self.kv = self.kvs[0]
        self.gen = g
        self.invalid: set = set()
        # The KV event batches the scheduler publishes (its publisher is vLLM's
        # null one; kv_events turns the events on).
        self.published: list = []
        self.transfer_stats: list = []  # the KV transfer stats vLLM's scheduler reported
        self.scheduler.kv_event_publisher.publish = self.published.append

    def connector(self) -> KvtierConnector:
        return self.scheduler.connector

    def forward(self, out) -> None:
        """Writes new random KV into the blocks of every token this step computes."""
        spans = [(r.req_id, r.num_computed_tokens, r.block_ids[0])
                 for r in out.scheduled_new_reqs]
        if self.decode_writes:
            cached = out.scheduled_cached_reqs
            spans += [(r, c, self.blocks_of(r))
                      for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True)]
        for req_id, first, blocks in spans:
            n = out.num_scheduled_tokens[req_id]
            for b in range(first // BLOCK, (first + n + BLOCK - 1) // BLOCK):
                for kv in self.kvs:
                    for t in kv.k + kv.v:
                        t[blocks[b]] = torch.randint(-100, 100, t[blocks[b]].shape,
                                                     generator=self.gen).to(torch.bfloat16)

    def step(self, writes: bool = True):
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        for w in self.workers:
            w.handle_preemptions(meta)  # vLLM 0.26+: before the step's inputs and forward
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            for name in self.caches:
                w.wait_for_layer_load(name)
        self.loaded = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        if writes:
            self.forward(out)
        finished = []
        self.invalid = set()
        for w in self.workers:
            if self.runner != "0.26" or out.total_num_scheduled_tokens > 0:
                w.wait_for_save()
            finished.append(w.get_finished(out.finished_req_ids))
            self.invalid |= w.get_block_ids_with_load_errors()
        # Rank 0's stats, as vLLM's executor reports the driver worker's.
        stats = self.worker.get_kv_connector_stats()
        for w in self.workers:
            w.clear_connector_metadata()
        sending, recving = self._every_rank(finished, 0), self._every_rank(finished, 1)
        req_ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                                  finished_recving=recving,
                                                  invalid_block_ids=self.invalid,
                                                  kv_connector_stats=stats))
        for eco in self.scheduler.update_from_output(out, mro).values():
            sched_stats = getattr(eco, "scheduler_stats", None)
            if sched_stats is not None and sched_stats.kv_connector_stats:
                self.transfer_stats.append(sched_stats.kv_connector_stats)
        return out

    def _every_rank(self, finished: list, i: int):
        """The requests every rank reported finished (vLLM's KVOutputAggregator
        waits for all of them), kept until then."""
        pending = self.__dict__.setdefault("_pending_finished", [{}, {}])[i]
        for f in finished:
            for req_id in f[i] or ():
                pending[req_id] = pending.get(req_id, 0) + 1
        done = {r for r, n in pending.items() if n == len(self.workers)}
        for r in done:
            del pending[r]
        return done or None

    def run_until_idle(self, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return
            self.step()
            time.sleep(0.01)  # the save thread
        raise AssertionError(f"requests left: {list(self.scheduler.requests)}")

    def blocks_of(self, req_id: str) -> list:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector().shutdown()


@contextlib.contextmanager
def _tp_rank(rank: int):
    """vLLM's parallel state answering ``rank`` as the tensor-parallel rank
    while a worker-side connector is made (it reads its rank then)."""
    from vllm.distributed import parallel_state
    saved = parallel_state.get_tensor_model_parallel_rank
    parallel_state.get_tensor_model_parallel_rank = lambda: rank
    try:
        yield
    finally:
        parallel_state.get_tensor_model_parallel_rank = saved


@pytest.fixture
def kvtierd(tmp_path):
    d = Daemon(tmp_path).start()
    yield d
    d.kill()


def _extra(d, **kw):
    return {"socket": d.socket, "codec": "k16v16", "chunk_tokens": CHUNK,
            "lookup_timeout_ms": 10000, **kw}


def _prompt(n: int, salt: int) -> list:
    return [(salt * 31 + i * 7) % 250 for i in range(n)]


def _save_prompt(model_dir, d, tokens, seed=0):
    """Runs a request through an engine so the connector saves its chunks; returns
    that engine's K/V of the prompt's tokens, [layers, tokens, heads, dim]."""
    eng = Engine(model_dir, _extra(d), seed=seed)
    req = make_request("writer", tokens)
    eng.scheduler.add_request(req)
    out = eng.step()
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    n = len(tokens) // BLOCK * BLOCK
    k, v = eng.kv.gather(blocks[:n // BLOCK])
    eng.run_until_idle()
    eng.shutdown()
    return k, v


@pytest.mark.parametrize("layerwise", [False, True])
def test_saved_prefix_is_scheduled_as_computed_and_loaded_exactly(model_dir, kvtierd, layerwise):
    extra = _extra(kvtierd, layerwise_load=layerwise)
    # Per-layer waits need vLLM's piecewise CUDA graphs; by default it keeps its full ones.
    assert KvtierConnector.requires_piecewise_for_cudagraph(extra) is layerwise
    tokens = _prompt(3 * CHUNK + 5, 43 if layerwise else 1)
    k, v = _save_prompt(model_dir, kvtierd, tokens)
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(keys) == ["dram"] * 3

    eng = Engine(model_dir, extra, seed=1)  # a fresh engine: no local prefix cache
    eng.scheduler.add_request(make_request("reader", tokens))
    out = eng.step(writes=False)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 3 * CHUNK
    assert out.num_scheduled_tokens["reader"] == 5
    assert eng.invalid == set()
    got_k, got_v = eng.kv.gather(list(new.block_ids[0])[:3 * CHUNK // BLOCK])
    assert torch.equal(got_k, k[:, :3 * CHUNK]) and torch.equal(got_v, v[:, :3 * CHUNK])
    eng.run_until_idle()
    # Nothing new to save: the three chunks were hits, the rest is not a full chunk.
    assert eng.worker.save_errors == 0
    eng.shutdown()


def test_tensor_parallel_ranks_store_and_load_their_own_shards(model_dir, kvtierd):
    # Tensor parallel 2: each rank's worker holds half the KV heads and stores
    # its own chunks (its rank is in their keys); a second engine of the same
    # size loads each rank's shard into that rank, exactly; an engine of
    # another size finds none of them.
    tokens = _prompt(3 * CHUNK + 5, 71)
    writer = Engine(model_dir, _extra(kvtierd), seed=1, tp=2)
    writer.scheduler.add_request(make_request("writer", tokens))
    out = writer.step()
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])[:3 * CHUNK // BLOCK]
    shards = [kv.gather(blocks) for kv in writer.kvs]
    writer.run_until_idle()
    writer.shutdown()
    assert shards[0][0].shape[2] == HEADS // 2
    assert not torch.equal(shards[0][0], shards[1][0])
    with kvtier.Client(socket=kvtierd.socket) as c:
        for rank in range(2):
            ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16", tp_world_size=2,
                                           tp_rank=rank)
            assert c.lookup(kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)) == ["dram"] * 3

    reader = Engine(model_dir, _extra(kvtierd), seed=2, tp=2)
    reader.scheduler.add_request(make_request("reader", tokens))
    out = reader.step(writes=False)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 3 * CHUNK
    assert reader.invalid == set()
    for rank, kv in enumerate(reader.kvs):
        k, v = kv.gather(list(new.block_ids[0])[:3 * CHUNK // BLOCK])
        assert torch.equal(k, shards[rank][0]) and torch.equal(v, shards[rank][1]), rank
    reader.run_until_idle()
    reader.shutdown()

    single = Engine(model_dir, _extra(kvtierd), seed=3)
    single.scheduler.add_request(make_request("single", tokens))
    out = single.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    single.run_until_idle()
    single.shutdown()


@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
def test_every_vllm_kv_layout_round_trips_k16v8(model_dir, kvtierd, layout):
    """Every KVCacheLayout of vLLM's allocator: a writer in that layout, a reader in
    the default one; K exact, V within FP8, the packed tensors' other bytes intact."""
    tokens = _prompt(2 * CHUNK + 1, 2 + len(layout))
    extra = _extra(kvtierd, codec="k16v8")
    eng = Engine(model_dir, extra, seed=3, layout=layout)
    layer = next(iter(eng.caches.values()))
    assert layer.dim() == 4 and tuple(layer.shape) == (NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
    assert eng.kv.layout == "packed"
    eng.scheduler.add_request(make_request("w", tokens))
    out = eng.step()
    k, v = eng.kv.gather(list(out.scheduled_new_reqs[0].block_ids[0])[:4])
    # The views are vLLM's: its FlashAttention split of the packed tensor sees the same K.
    k_vllm = layer.transpose(1, 2).split(DIM, dim=-1)[0]
    ids = list(out.scheduled_new_reqs[0].block_ids[0])[:4]
    assert torch.equal(k[0], k_vllm[ids].reshape(4 * BLOCK, HEADS, DIM))
    eng.run_until_idle()
    eng.shutdown()
    eng = Engine(model_dir, extra, seed=4)  # a reader in vLLM's default layout
    before = {n: t.clone() for n, t in eng.caches.items()}
    eng.scheduler.add_request(make_request("r", tokens))
    out = eng.step(writes=False)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    ids = list(out.scheduled_new_reqs[0].block_ids[0])[:4]
    got_k, got_v = eng.kv.gather(ids)
    assert torch.equal(got_k, k)  # K16 is exact
    assert torch.allclose(got_v.float(), v.float(), rtol=0.07, atol=1e-2)  # V through FP8
    others = [b for b in range(NUM_BLOCKS) if b not in ids]
    for name, t in eng.caches.items():
        assert torch.equal(t[others], before[name][others])  # no other block was written
    eng.run_until_idle()
    eng.shutdown()


def test_a_packed_layer_of_another_head_size_is_a_clear_error(model_dir, kvtierd):
    eng = Engine(model_dir, _extra(kvtierd))
    odd = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 3 * DIM, dtype=torch.bfloat16)
           for n in eng.caches}
    with pytest.raises(ValueError, match="not 2 \\* head_dim"):
        eng.worker.register_kv_caches(odd)
    eng.shutdown()


def test_saves_are_not_lost_when_the_runner_skips_wait_for_save(model_dir, kvtierd):
    """vLLM 0.26-0.30 call no wait_for_save on a step that runs no tokens; the step
    after the last request finished is such a step, and carries its saves."""
    tokens = _prompt(2 * CHUNK + 3, 9)
    eng = Engine(model_dir, _extra(kvtierd), runner="0.26")
    eng.scheduler.add_request(make_request("last", tokens))
    eng.step()  # prefill; the request finishes (max_tokens 1)
    out = eng.step()  # nothing to run: only the saves of "last"
    assert out.total_num_scheduled_tokens == 0
    eng.run_until_idle()
    assert "last" not in eng.scheduler.requests  # its blocks were released
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)) == ["dram"] * 2
    eng.shutdown()


def test_a_finished_requests_save_does_not_wait_for_the_next_forward(model_dir, kvtierd):
    """The runner binds a step's metadata, runs its forward, then calls wait_for_save.
    The saves in that metadata are of requests that finished in earlier steps, so
    they run from the bind on: behind the next request's prefill, not after it
    and beside its decode steps."""
    eng = Engine(model_dir, _extra(kvtierd))
    eng.scheduler.add_request(make_request("a", _prompt(2 * CHUNK + 3, 41)))
    eng.step()  # prefill; "a" finishes (max_tokens 1), its saves go into the next step
    eng.scheduler.add_request(make_request("b", _prompt(CHUNK + 1, 42)))
    w = eng.worker
    seen = []

    def forward(out):
        # The forward of "b" waits for the save of "a": with saves submitted only
        # after the forward this would never see it done.
        with w._saves_idle:
            w._saves_idle.wait_for(lambda: w._pending_save_chunks == 0 and "a" in w._saved,
                                   timeout=30)
            seen.append((w._pending_save_chunks, "a" in w._saved))
        Engine.forward(eng, out)

    eng.forward = forward
    out = eng.step()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    assert seen == [(0, True)]
    assert w.save_errors == 0
    eng.run_until_idle()
    eng.shutdown()


@pytest.mark.parametrize("running", [True, False])
def test_a_running_requests_prompt_is_stored_while_it_decodes(model_dir, kvtierd, running):
    """save_while_running: the step after a prefill hands the prompt's chunks to
    the workers, who store them while the request decodes; when it finishes, only
    the chunk its output completed is left to store, and nothing is stored twice.
    Off, every chunk is stored at the finish."""
    tokens = _prompt(2 * CHUNK + 3, 51)
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    # The fake model samples token 7; the output completes a third chunk.
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens + [7] * CHUNK, CHUNK)[:3]
    eng = Engine(model_dir, _extra(kvtierd, save_while_running=running))
    saved = _count_saves(eng)
    eng.scheduler.add_request(make_request("r", tokens, max_tokens=CHUNK))
    assert eng.step().kv_connector_metadata.saves == []  # the prefill
    jobs = eng.step().kv_connector_metadata.saves  # the first decode step
    if running:
        assert [(j.req_id, j.running, len(j.keys)) for j in jobs] == [("r", True, 2)]
        with kvtier.Client(socket=kvtierd.socket) as c:
            eventually(lambda: c.lookup(keys[:2]) == ["dram"] * 2)
        assert not eng.scheduler.requests["r"].is_finished()
    else:
        assert jobs == []
    eng.run_until_idle()
    assert saved == [bytes(k) for k in keys]
    assert eng.worker.save_errors == 0
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(keys) == ["dram"] * 3
    eng.shutdown()


def test_a_request_preempted_while_its_prompt_is_stored_waits_for_the_store(model_dir,
                                                                             kvtierd):
    """vLLM preempts a running request when the cache is full and gives its blocks
    to others in the same step. Its prompt's store (handed over while it ran) may
    still be reading them: the workers finish it in handle_preemptions, before
    the step's forward writes any block."""
    eng = Engine(model_dir, _extra(kvtierd), decode_writes=True)
    order: list = []
    mover = eng.worker.mover
    real_save_many = mover.save_many

    def slow_save_many(keys, block_ids, **kw):
        time.sleep(0.3)  # still in flight when the preemption comes
        out = real_save_many(keys, block_ids, **kw)
        order.append(("stored", len(keys)))
        return out
    mover.save_many = slow_save_many

    def forward(out):
        order.append(("forward", tuple(out.preempted_req_ids or ())))
        Engine.forward(eng, out)
    eng.forward = forward
    # Two prompts of 30 blocks each in a cache of 63: their decodes need the
    # 32nd blocks at token 497, and the second one is preempted.
    for req_id, salt in (("a", 61), ("b", 62)):
        eng.scheduler.add_request(make_request(req_id, _prompt(15 * CHUNK, salt), max_tokens=24))
    assert len(eng.step().scheduled_new_reqs) == 2
    for _ in range(30):
        out = eng.step()
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"b"}
    assert out.kv_connector_metadata.preempted == ["b"]
    # Both prompts' saves (a's, then b's, on the one save thread) ended before the
    # forward of the step that preempted b.
    assert order.index(("stored", 15), order.index(("stored", 15)) + 1) < \
        order.index(("forward", ("b",)))
    eng.run_until_idle(max_steps=100)
    assert eng.worker.save_errors == 0 and eng.worker.load_errors == 0
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    with kvtier.Client(socket=kvtierd.socket) as c:
        for salt in (61, 62):
            keys = kvtier.chunk_keys(ident.fingerprint(), _prompt(15 * CHUNK, salt), CHUNK)
            assert c.lookup(keys) == ["dram"] * 15
    eng.shutdown()


def test_connector_reports_hit_tiers_and_is_a_best_effort_cache(model_dir, kvtierd):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    tokens = _prompt(3 * CHUNK + 5, 10)
    _save_prompt(model_dir, kvtierd, tokens)
    eng = Engine(model_dir, _extra(kvtierd), seed=1)
    assert eng.worker.requires_kv_delivery is False
    assert eng.connector().requires_kv_delivery is False
    req = make_request("r", tokens, max_tokens=4)  # still running after the step
    eng.scheduler.add_request(req)
    out = eng.step(writes=False)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * CHUNK
    sources = eng.connector().get_external_cache_hit_sources(req, 3 * CHUNK)
    assert sources == {CacheHitSource.HOST: 3 * CHUNK}  # kvtierd's DRAM
    eng.run_until_idle()
    eng.shutdown()


def test_blocks_are_kept_until_the_save_is_done(model_dir, kvtierd):
    eng = Engine(model_dir, _extra(kvtierd))
    tokens = _prompt(2 * CHUNK + 3, 3)
    eng.scheduler.add_request(make_request("a", tokens))
    eng.step()
    # The request finished (max_tokens 1); its blocks stay with the scheduler until
    # the worker reports the save.
    assert "a" in eng.scheduler.requests
    eng.run_until_idle()
    assert "a" not in eng.scheduler.requests
    with kvtier.Client(socket=kvtierd.socket) as c:
        ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
        assert len(c.lookup(kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK))) == 2
    eng.shutdown()


@pytest.mark.parametrize("fault", ["corrupt", "missing"])
def test_a_bad_chunk_is_a_load_error_and_is_recomputed(model_dir, kvtierd, fault):
    tokens = _prompt(3 * CHUNK + 5, 4 if fault == "corrupt" else 5)
    _save_prompt(model_dir, kvtierd, tokens)
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)
    eng = Engine(model_dir, _extra(kvtierd), seed=7)
    eng.scheduler.add_request(make_request("r", tokens))
    # The lookup (at schedule time) still sees chunk 1; it goes bad before the load.
    original = eng.worker.start_load_kv

    def spoil_then_load(ctx, **kw):
        with kvtier.Client(socket=kvtierd.socket) as c:
            if fault == "corrupt":
                corrupt_in_pool(c, keys[1])
            else:
                c.delete(keys[1])
        original(ctx, **kw)

    eng.worker.start_load_kv = spoil_then_load
    out = eng.step(writes=False)
    eng.worker.start_load_kv = original
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * CHUNK
    assert eng.invalid == set(blocks[2:4])  # chunk 1's blocks
    assert eng.worker.load_errors == 1
    req = eng.scheduler.requests["r"]
    assert req.num_computed_tokens == CHUNK  # vLLM recomputes from chunk 1 on
    out = eng.step()
    assert out.num_scheduled_tokens["r"] == len(tokens) - CHUNK
    eng.run_until_idle()
    eng.shutdown()
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(keys) == ["dram"] * 3  # stored again after the recompute


def test_a_stopped_daemon_costs_the_timeout_and_is_a_miss(model_dir, kvtierd):
    tokens = _prompt(3 * CHUNK + 5, 6)
    _save_prompt(model_dir, kvtierd, tokens)
    eng = Engine(model_dir, _extra(kvtierd, lookup_timeout_ms=300, retry_after_ms=0))
    lookup = eng.connector().lookup
    eventually(lambda: lookup.plan([bytes(16)], 0.0, CHUNK))  # connects its client
    lookup.misses = dict.fromkeys(lookup.misses, 0)
    kvtierd.pause()
    try:
        eng.scheduler.add_request(make_request("r", tokens))
        t0 = time.monotonic()
        out = eng.scheduler.schedule()
        took = time.monotonic() - t0
        assert took < 1.5, took
        new = [r for r in out.scheduled_new_reqs if r.req_id == "r"][0]
        assert new.num_computed_tokens == 0 and out.num_scheduled_tokens["r"] == len(tokens)
        # The lookup's deadline or the client's own (the same length) ends it.
        assert lookup.misses["timeout"] + lookup.misses["error"] == 1
    finally:
        kvtierd.resume()
    eng.connector().shutdown()


def test_kv_role_producer_only_saves_and_consumer_only_loads(model_dir, kvtierd):
    tokens = _prompt(2 * CHUNK + 1, 8)
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)
    consumer = Engine(model_dir, _extra(kvtierd), kv_role="kv_consumer")
    consumer.scheduler.add_request(make_request("c", tokens))
    consumer.run_until_idle()  # nothing cached, and a consumer does not save
    consumer.shutdown()
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(keys) == []
    producer = Engine(model_dir, _extra(kvtierd), kv_role="kv_producer")
    producer.scheduler.add_request(make_request("p", tokens))
    producer.run_until_idle()
    producer.shutdown()
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(keys) == ["dram"] * 2
    producer = Engine(model_dir, _extra(kvtierd), kv_role="kv_producer")  # empty local cache
    producer.scheduler.add_request(make_request("p2", tokens))
    out = producer.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # a producer does not load
    producer.run_until_idle()
    producer.shutdown()
    consumer = Engine(model_dir, _extra(kvtierd), kv_role="kv_consumer")
    consumer.scheduler.add_request(make_request("c2", tokens))
    out = consumer.step(writes=False)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    consumer.run_until_idle()
    consumer.shutdown()


def _count_saves(eng) -> list:
    """The keys the engine's worker stores, in order."""
    saved: list = []
    mover = eng.worker.mover
    real_save = mover.save

    def save(key, block_ids, **kw):
        saved.append(bytes(key))
        return real_save(key, block_ids, **kw)
    mover.save = save
    return saved


def test_a_prefix_that_vllms_own_cache_served_is_not_stored_again(model_dir, kvtierd):
    """A request whose prefix vLLM's prefix cache computed (no lookup ran) stores
    only the chunks kvtierd lacks: none of a prefix this engine stored, and of a
    longer prompt only its new chunk."""
    tokens = _prompt(2 * CHUNK + 3, 15)
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    eng = Engine(model_dir, _extra(kvtierd))
    saved = _count_saves(eng)
    eng.scheduler.add_request(make_request("a", tokens))
    eng.run_until_idle()
    assert len(saved) == 2
    eng.scheduler.add_request(make_request("b", tokens[:2 * CHUNK] + [5, 6, 7]))
    out = eng.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK  # vLLM's own hit
    eng.run_until_idle()
    assert len(saved) == 2
    longer = tokens[:2 * CHUNK] + _prompt(CHUNK + 2, 16)
    eng.scheduler.add_request(make_request("c", longer))
    eng.run_until_idle()
    assert saved[2:] == [kvtier.chunk_keys(ident.fingerprint(), longer, CHUNK)[2]]
    assert eng.worker.save_errors == 0
    eng.shutdown()


def test_a_producer_asks_kvtierd_before_storing_a_prefix_again(model_dir, kvtierd):
    """A saving-only engine runs no lookup when it schedules; before storing, it
    asks kvtierd, so chunks another engine stored are not stored twice."""
    tokens = _prompt(2 * CHUNK + 1, 17)
    first = Engine(model_dir, _extra(kvtierd), kv_role="kv_producer")
    first.scheduler.add_request(make_request("p", tokens))
    first.run_until_idle()
    first.shutdown()
    other = Engine(model_dir, _extra(kvtierd), kv_role="kv_producer")
    saved = _count_saves(other)
    other.scheduler.add_request(make_request("p2", tokens + [9] * CHUNK))
    other.run_until_idle()
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens + [9] * CHUNK, CHUNK)
    assert saved == [keys[2]]  # the first two were in kvtierd
    other.shutdown()


def test_transfer_counts_reach_vllms_stats_logger_and_prometheus(model_dir, kvtierd):
    """The worker's counts travel the way vLLM's runner sends them: through the
    scheduler's stats into KVConnectorLogging and the vllm:kvtier_* counters."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    tokens = _prompt(2 * CHUNK + 3, 18)
    writer = Engine(model_dir, _extra(kvtierd))
    writer.scheduler.add_request(make_request("w", tokens))
    writer.run_until_idle()
    writer.shutdown()
    stored = sum(s.get("chunks_stored", 0) for s in writer.transfer_stats)
    assert stored == 2
    assert sum(s.get("store_seconds", 0) for s in writer.transfer_stats) > 0
    # Two chunks' blocks kept at least as long as the saver worked on them.
    per_chunk = CHUNK // BLOCK
    held = sum(s.get("store_block_seconds", 0) for s in writer.transfer_stats)
    saving = sum(s.get("store_seconds", 0) for s in writer.transfer_stats)
    assert held > 0 and held >= 2 * per_chunk * saving - 1e-3  # both rounded
    reader = Engine(model_dir, _extra(kvtierd), seed=1)
    reader.scheduler.add_request(make_request("r", tokens))
    reader.run_until_idle()
    reader.shutdown()
    assert sum(s.get("chunks_loaded", 0) for s in reader.transfer_stats) == 2
    assert sum(s.get("load_errors", 0) for s in reader.transfer_stats) == 0

    logging = KVConnectorLogging(reader.config.kv_transfer_config)
    for data in writer.transfer_stats + reader.transfer_stats:
        logging.observe(data)
    lines: list = []
    logging.log(lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1 and "chunks_stored=2" in lines[0] and "chunks_loaded=2" in lines[0]

    prom = KVConnectorProm(reader.config, ["engine"], {0: ["0"]})
    for data in writer.transfer_stats + reader.transfer_stats:
        prom.observe(data, 0)
    try:
        assert REGISTRY.get_sample_value("vllm:kvtier_chunks_stored_total",
                                         {"engine": "0"}) == 2
        assert REGISTRY.get_sample_value("vllm:kvtier_chunks_loaded_total",
                                         {"engine": "0"}) == 2
    finally:  # as vLLM's own metrics logger does before it registers again
        for collector, names in list(REGISTRY._collector_to_names.items()):
            if any(n.startswith("vllm:kvtier") for n in names):
                REGISTRY.unregister(collector)


def _tokens_loaded_then_shut_down(eng, tokens) -> int:
    """The tokens a request of ``tokens`` starts with as computed (loaded); then
    runs the engine to idle and shuts it down."""
    eng.scheduler.add_request(make_request("reader", tokens))
    out = eng.step(writes=False)
    loaded = out.scheduled_new_reqs[0].num_computed_tokens
    eng.run_until_idle()
    eng.shutdown()
    return loaded


def test_the_plan_prices_attention_from_the_models_config(model_dir, kvtierd):
    """With a prefill rate, the scheduler's plan adds the attention term of the
    model's config (the tiny Llama's C2: (2*64*64 + 2*64*32 + 3*64*64) /
    (2*64) = 192 tokens). At 2M tokens/s a 32-token chunk recomputes in 16 us
    by tokens alone, less than its DRAM load (~21 us), but chunk i costs
    16 * (1 + (32i + 16) / 192) us with the term: a long prompt's 8 chunks
    are worth loading. attention_doubling_tokens 0 keeps the linear cost."""
    tokens = _prompt(8 * CHUNK + 1, 21)
    _save_prompt(model_dir, kvtierd, tokens)
    for extra, c2, loaded in [({}, 192.0, 8 * CHUNK),
                              ({"attention_doubling_tokens": 0}, 0.0, 0)]:
        eng = Engine(model_dir, _extra(kvtierd, prefill_tokens_per_s=2e6, **extra), seed=1)
        assert eng.connector().attention_doubling_tokens == c2
        assert _tokens_loaded_then_shut_down(eng, tokens) == loaded, extra


def test_a_measured_prefill_rate_decides_load_or_recompute(model_dir, kvtierd):
    """measure_prefill_rate: the scheduler times its own steps and plans at that
    rate. An engine whose steps take 10 us (a 64-token prefill: ~7.5M weighted
    tokens/s) recomputes 32-token chunks faster than they load from DRAM
    (~21 us): it loads nothing; one whose steps take 1 ms loads the whole
    prefix. Until 8 steps are measured it loads every hit."""
    tokens = _prompt(8 * CHUNK + 1, 23)
    _save_prompt(model_dir, kvtierd, tokens)
    for step_s, loaded in [(1e-5, 0), (1e-3, 8 * CHUNK)]:
        eng = Engine(model_dir, _extra(kvtierd, measure_prefill_rate=True), seed=1)
        meter = eng.connector()._prefill_meter
        now = [0.0]

        def tick(now=now, step_s=step_s):
            now[0] += step_s
            return now[0]
        meter._clock = tick
        assert eng.connector().prefill_tokens_per_s() == 0.0
        for i in range(9):  # prefill steps of 2 chunks, each followed by a decode step
            eng.scheduler.add_request(make_request(f"warm{i}", _prompt(2 * CHUNK, 40 + i),
                                                   max_tokens=2))
            eng.run_until_idle()
        assert eng.connector().prefill_tokens_per_s() > 0
        assert _tokens_loaded_then_shut_down(eng, tokens) == loaded, step_s


def test_a_hybrid_model_is_refused_with_the_flag_to_pass(model_dir, kvtierd):
    config = vllm_config(model_dir, _extra(kvtierd))
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        KvtierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(groups=2))


@pytest.mark.parametrize("field", ["pipeline_parallel_size", "decode_context_parallel_size",
                                   "prefill_context_parallel_size"])
def test_pipeline_and_context_parallelism_are_refused_with_the_flag_to_pass(model_dir, kvtierd,
                                                                             field):
    config = vllm_config(model_dir, _extra(kvtierd))
    setattr(config.parallel_config, field, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} 1"):
            KvtierConnector(config, role, kv_cache_config())


def test_an_mla_model_is_refused(model_dir, kvtierd, monkeypatch):
    # vLLM's ModelConfig.use_mla says whether the model's cache is MLA's latent KV.
    monkeypatch.setattr(ModelConfig, "use_mla", property(lambda self: True))
    config = vllm_config(model_dir, _extra(kvtierd))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="MLA models"):
            KvtierConnector(config, role, kv_cache_config())


def test_bad_extra_config_is_a_clear_error(model_dir, kvtierd):
    for extra, words in [({"chunk_tokens": 24}, "multiple of vLLM's block size"),
                         ({"sockett": "/x"}, "unknown setting 'sockett'")]:
        with pytest.raises(ValueError, match=words):
            KvtierConnector(vllm_config(model_dir, {"socket": kvtierd.socket, **extra}),
                            KVConnectorRole.SCHEDULER, kv_cache_config())
    with pytest.raises(ValueError, match="16-bit"):
        KvtierConnector(vllm_config(model_dir, _extra(kvtierd), cache_dtype="fp8"),
                        KVConnectorRole.SCHEDULER, kv_cache_config())


def test_a_full_save_queue_skips_the_save_and_frees_the_blocks(model_dir, kvtierd):
    """Saves never stall the engine: past max_pending_save_chunks a request's
    chunks are skipped (counted) and its blocks go back to vLLM at once."""
    tokens = _prompt(2 * CHUNK + 3, 11)
    eng = Engine(model_dir, _extra(kvtierd, max_pending_save_chunks=1))
    eng.scheduler.add_request(make_request("big", tokens))
    eng.step()  # finishes; its 2 chunks do not fit a queue of 1
    eng.step()
    assert "big" not in eng.scheduler.requests
    assert eng.worker.saves_skipped == 2 and eng.worker.save_errors == 0
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)) == []
    eng.shutdown()


def test_a_skipped_save_is_stored_by_a_later_request_that_vllm_served(model_dir, kvtierd):
    """A save that was skipped (or failed) does not count as held: a later
    request whose prefix vLLM's own cache served asks kvtierd and stores it."""
    tokens = _prompt(3 * CHUNK + 3, 19)
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)
    eng = Engine(model_dir, _extra(kvtierd, max_pending_save_chunks=2))
    saved = _count_saves(eng)
    eng.scheduler.add_request(make_request("big", tokens))
    eng.run_until_idle()
    assert eng.worker.saves_skipped == 3 and saved == []
    eng.scheduler.add_request(make_request("again", tokens[:2 * CHUNK] + [5, 6, 7]))
    out = eng.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK  # vLLM's own hit
    eng.run_until_idle()
    assert saved == [bytes(k) for k in keys[:2]]
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert len(c.lookup(keys)) == 2
    eng.shutdown()


def _kvtier_events(batches) -> list:
    return [e for b in batches for e in b.events
            if isinstance(getattr(e, "medium", None), str) and e.medium.startswith("kvtier:")]


def test_stored_chunks_are_published_as_kv_events_once_saved(model_dir, kvtierd):
    """With vLLM's KV events on, each chunk a request's save put in kvtierd is a
    BlockStored of the chunk's blocks (vLLM's block hashes and tokens, medium
    kvtier's tier), published by the scheduler in the step whose connector
    output reports the save done, and not before."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    tokens = _prompt(3 * CHUNK + 5, 12)
    eng = Engine(model_dir, _extra(kvtierd), kv_events=True)
    req = make_request("a", tokens)
    eng.scheduler.add_request(req)
    for _ in range(50):
        assert _kvtier_events(eng.published) == []  # nothing before the save is done
        before = len(eng.published)
        eng.step()
        if "a" not in eng.scheduler.requests:
            break
        time.sleep(0.01)
    assert "a" not in eng.scheduler.requests
    # The step whose connector output reported the save done (and freed the blocks).
    assert len(eng.published) == before + 1
    events = _kvtier_events(eng.published[before:])
    assert len(events) == 3 and _kvtier_events(eng.published) == events
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    per = CHUNK // BLOCK
    for c, e in enumerate(events):
        assert isinstance(e, BlockStored)
        assert e.medium == "kvtier:dram"
        assert e.block_hashes == hashes[c * per:(c + 1) * per]
        assert e.parent_block_hash == (hashes[c * per - 1] if c else None)
        assert list(e.token_ids) == tokens[c * CHUNK:(c + 1) * CHUNK]
        assert e.block_size == BLOCK and e.lora_id is None
    # vLLM's own events of the same step (its GPU blocks) go out beside them, and
    # the batch survives the publisher's encoding.
    batch = eng.published[-1]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch)
    assert _kvtier_events([wire]) == events
    eng.shutdown()


def test_a_skipped_save_publishes_no_kv_events(model_dir, kvtierd):
    tokens = _prompt(2 * CHUNK + 3, 13)
    eng = Engine(model_dir, _extra(kvtierd, max_pending_save_chunks=1), kv_events=True)
    eng.scheduler.add_request(make_request("big", tokens))
    eng.run_until_idle()
    assert eng.worker.saves_skipped == 2
    assert _kvtier_events(eng.published) == []
    eng.shutdown()


def test_kv_events_off_costs_no_lookup(model_dir, kvtierd):
    tokens = _prompt(2 * CHUNK + 3, 14)
    eng = Engine(model_dir, _extra(kvtierd))
    lookup = eng.connector().lookup
    plans = []
    real_plan = lookup.plan
    lookup.plan = lambda *a, **kw: plans.append(a) or real_plan(*a, **kw)
    eng.scheduler.add_request(make_request("a", tokens))
    eng.run_until_idle()
    assert len(plans) == 1  # the scheduling lookup; none after the save
    assert list(eng.connector().take_events()) == []
    eng.shutdown()


def test_sleep_mode_drops_the_kv_tensors_and_wake_up_registers_them_again(model_dir, kvtierd):
    """vLLM 0.33's sleep and wake-up in the order of its engine core and GPU
    worker: the pause drains the requests (their saves too) and resets the
    prefix cache, Worker.sleep calls unregister_kv_caches before the sleep
    backend releases the KV memory (its addresses stay, its contents go),
    Worker.wake_up calls restore_kv_caches after mapping it again. After the
    wake-up a saved prefix loads exactly into vLLM's tensors, and saves work."""
    assert KvtierConnector.supports_sleep_mode(
        vllm_config(model_dir, _extra(kvtierd)).kv_transfer_config)
    tokens = _prompt(2 * CHUNK + 3, 15)
    eng = Engine(model_dir, _extra(kvtierd), seed=5)
    eng.scheduler.add_request(make_request("a", tokens))
    out = eng.step()
    k, v = eng.kv.gather(list(out.scheduled_new_reqs[0].block_ids[0])[:4])
    eng.run_until_idle()  # the pause waits for the requests and their saves
    assert eng.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    worker = eng.worker
    worker.unregister_kv_caches()  # Worker.sleep
    assert worker.mover is None
    worker.unregister_kv_caches()  # idempotent
    for t in eng.caches.values():
        t.fill_(float("nan"))  # what the released memory holds after the wake-up
    worker.restore_kv_caches()  # Worker.wake_up
    mover = worker.mover
    assert mover is not None
    worker.restore_kv_caches()  # idempotent
    assert worker.mover is mover
    eng.kv = mover.kv

    eng.scheduler.add_request(make_request("b", tokens))  # no local prefix cache left
    out = eng.step(writes=False)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CHUNK
    ids = list(new.block_ids[0])[:4]
    layer0 = next(iter(eng.caches.values()))  # vLLM's own tensor holds the loaded KV
    assert torch.equal(layer0[ids].transpose(1, 2).split(DIM, dim=-1)[0].reshape(k[0].shape),
                       k[0])
    got_k, got_v = eng.kv.gather(ids)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    eng.run_until_idle()
    other = _prompt(2 * CHUNK + 3, 16)
    eng.scheduler.add_request(make_request("c", other))
    eng.run_until_idle()
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(kvtier.chunk_keys(ident.fingerprint(), other, CHUNK)) == ["dram"] * 2
    assert worker.save_errors == 0 and worker.load_errors == 0
    eng.shutdown()


def test_unregister_kv_caches_waits_for_saves_in_flight(model_dir, kvtierd):
    """A save the worker already started is stored before unregister_kv_caches
    drops the tensors, whether or not vLLM's pause drained the saves first;
    while unregistered, metadata with loads or saves is a clear error."""
    tokens = _prompt(2 * CHUNK + 3, 17)
    ident = engine.engine_identity(model_dir, torch.bfloat16, "k16v16")
    keys = kvtier.chunk_keys(ident.fingerprint(), tokens, CHUNK)
    eng = Engine(model_dir, _extra(kvtierd))
    worker = eng.worker
    eng.scheduler.add_request(make_request("a", tokens))
    eng.step()  # the request finishes; its saves go out with the next step
    out = eng.scheduler.schedule()
    assert [job.req_id for job in out.kv_connector_metadata.saves] == ["a"]
    kvtierd.pause()  # the saves stall in kvtierd
    try:
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        sleeper = threading.Thread(target=worker.unregister_kv_caches)
        sleeper.start()
        sleeper.join(0.5)
        assert sleeper.is_alive() and worker.mover is not None
    finally:
        kvtierd.resume()
    sleeper.join(30)
    assert not sleeper.is_alive() and worker.mover is None
    with kvtier.Client(socket=kvtierd.socket) as c:
        assert c.lookup(keys) == ["dram"] * 2
    assert worker.get_finished(out.finished_req_ids) == ({"a"}, None)
    for meta in (KvtierConnectorMetadata(loads=[ChunkJob("x", [keys[0]], [[0, 1]])]),
                 KvtierConnectorMetadata(saves=[ChunkJob("y", [keys[1]], [[2, 3]])])):
        with pytest.raises(RuntimeError, match="unregistered .*restore_kv_caches"):
            worker.bind_connector_metadata(meta)
    worker.bind_connector_metadata(KvtierConnectorMetadata())  # a step with nothing to move
    worker.clear_connector_metadata()
    eng.shutdown()

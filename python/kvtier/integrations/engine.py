"""The engine-neutral core of kvtier's engine connectors (``kvtier.vllm``,
``kvtier.sglang``): settings, keys, a lookup that never holds a scheduler,
and the mover that turns an engine's block ids and KV cache layout into
kvtier stores and loads.

Nothing here imports an engine, so the same calls run wherever torch does:
CPU tensors go through the CPU codec (``kvtier.torch.encode_chunk`` /
``decode_chunk``), CUDA tensors through the GPU path of ``kvtier/torch/_gpu.py``
(``store``, ``load_layerwise``).

Keys are engine-neutral. A chunk holds K (after RoPE) and V of
``chunk_tokens`` consecutive tokens for every layer, [layers, tokens,
kv_heads, head_dim], whatever layout the engine keeps them in; its key is
``kvtier.chunk_keys`` over the token ids under the identity of
``engine_identity``, whose ``kv_layout`` (``KV_LAYOUT``) is the one
``kvtier.hf`` uses. So a prefix stored by vLLM is found by kvtier.hf and by any
other caller that passes the same model id, revision, dtype, codec, tensor
parallel shard and chunk size.
"""
from __future__ import annotations

import array
import collections
import concurrent.futures
import dataclasses
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

import kvtier
import kvtier.torch as kvtorch
from kvtier.torch import DTYPE_NAMES

logger = logging.getLogger("kvtier.engine")

#: kv_layout of every engine's identity and of kvtier.hf's: the chunk's own
#: layout (K after RoPE, [tokens, kv_heads, head_dim] per layer).
KV_LAYOUT = "hf-nhd"

#: Layouts of one layer's paged KV. Stacked (one tensor per layer):
#:   flash_attn_nhd [2, num_blocks, block_size, kv_heads, head_dim]
#:   flash_attn_hnd [2, num_blocks, kv_heads, block_size, head_dim]
#:   flashinfer_nhd [num_blocks, 2, block_size, kv_heads, head_dim]
#:   flashinfer_hnd [num_blocks, 2, kv_heads, block_size, head_dim]
#: Separate (a (K, V) pair per layer, each of the shape after the name):
#:   nhd [num_blocks, block_size, kv_heads, head_dim]
#:   hnd [num_blocks, kv_heads, block_size, head_dim]
#: Packed (one 4-D tensor per layer, K and V side by side in the last dimension):
#:   packed [num_blocks, kv_heads, block_size, 2 * head_dim], K in [..., :head_dim],
#:   V in [..., head_dim:]: what every attention backend of vLLM 0.26 and later
#:   hands a connector (vLLM's logical [B, H, N, C] view, in whatever memory
#:   order its KVCacheLayout gives: LBHNC, LBNHC, BLHNC, ...).
#: Any strides are taken as they are, so vLLM's HND caches (a logical NHD
#: shape over HND memory) are "…_nhd" views too.
STACKED_LAYOUTS = ("flash_attn_nhd", "flash_attn_hnd", "flashinfer_nhd", "flashinfer_hnd")
SEPARATE_LAYOUTS = ("nhd", "hnd")
PACKED_LAYOUT = "packed"

# A chunk that cannot be used ends the usable prefix; its tokens are recomputed.
UNUSABLE = (kvtier.NotFound, kvtier.DataLoss, kvtier.InvalidArgument)

# The type of each setting that is not a string (ConnectorSettings.from_mapping).
_SETTING_TYPES: dict[str, type | tuple[type, ...]] = {
    "chunk_tokens": int, "lookup_timeout_ms": int, "retry_after_ms": int, "io_timeout_ms": int,
    "layer_group": int, "max_pending_save_chunks": int, "prefill_tokens_per_s": (int, float),
    "attention_doubling_tokens": (int, float), "measure_prefill_rate": bool,
    "layerwise_load": bool, "save_while_running": bool, "page_threads": int}


# ---- settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """What a connector reads from its engine's extra config (a JSON object).

    socket: kvtierd's Unix socket. Default: ./kvtier-data/kvtierd.sock.
    addr: "HOST:PORT" of kvtierd's TCP listener instead of the socket. Default: none.
    token_file: bearer token file (required with addr). Default: none.
    codec: chunk codec, "k16v8" (V in FP8) or "k16v16" (lossless), or any
      codec name of codec/FORMAT.md. Default: "k16v8".
    chunk_tokens: tokens per chunk; a multiple of the engine's block (page)
      size. Engines share chunks only with equal chunk_tokens. Default: 256.
    model_id: the model id in the keys. Default: the engine's model name.
    revision: the model revision in the keys. Default: "".
    lookup_timeout_ms: the longest a scheduler-side lookup may take; a slower
      or dead kvtierd counts as a miss. Default: 200.
    retry_after_ms: after a lookup failed or timed out, lookups are misses for
      this long without asking kvtierd. Default: 1000.
    load_policy: "plan" loads what kvtierd's load plan says is faster to load
      than to recompute at prefill_tokens_per_s (every hit when the rate is 0);
      "all" loads every hit. Default: "plan".
    prefill_tokens_per_s: the engine's prefill rate, tokens/s, for the plan:
      at short context (a few hundred tokens) when attention_doubling_tokens
      is not 0. Default: 0.
    attention_doubling_tokens: C2, the context length in tokens at which one
      token's prefill costs twice its short-context cost; the plan prices the
      recompute of tokens [a, a + n) at 1e6 * n / r * (1 + (a + n/2) / C2)
      microseconds (r = prefill_tokens_per_s), so later chunks of a long
      prefix cost more; 0 prices every token at 1 / r. Default: None, derived
      from the model's config where the connector has it
      (``attention_doubling_tokens(config)``), else 0.
    measure_prefill_rate: with prefill_tokens_per_s 0, the scheduler measures
      the engine's prefill rate from its own steps (PrefillRateMeter) and plans
      at it once it has enough steps; until then every hit is loaded.
      Default: False.
    io_timeout_ms: deadline of the worker's store and load calls. Default: 60000.
    kv_cache_layout: the layout of the engine's KV tensors (PACKED_LAYOUT,
      STACKED_LAYOUTS / SEPARATE_LAYOUTS). Default: inferred from the shapes.
    layerwise_load: vLLM on CUDA: the forward waits for each layer's load just
      before that layer (wait_for_layer_load), so the load overlaps the
      forward's earlier layers; vLLM then runs piecewise CUDA graphs, which
      slow every decode step. False: the forward waits, on the device, for the
      whole load before its first kernel and runs vLLM's full CUDA graphs.
      Default: False.
    layer_group: with layerwise_load, layers per step of a GPU load (one
      decode launch per chunk and group): larger groups launch less, smaller
      ones let layer 0 start sooner. Default: 4.
    max_pending_save_chunks: chunks waiting to be stored at most; the chunks of a
      request that would go past it are not stored (counted as skipped) and its
      blocks go back to the engine at once, so saves never hold the engine's
      memory or thread. Default: 1024.
    save_while_running: vLLM: a request's prompt chunks are stored once its
      prefill computed them, while it decodes, so that when it finishes only
      the chunks of its output keep its blocks from the engine; False: every
      chunk is stored when the request finishes. Default: True.
    page_threads: SGLang: threads a batch of host pages is encoded (backups)
      or decoded (prefetches) on, in libkvtier, outside the interpreter lock
      (1-64). Default: 8.
    """
    socket: str | None = None
    addr: str | None = None
    token_file: str | None = None
    codec: str = "k16v8"
    chunk_tokens: int = 256
    model_id: str | None = None
    revision: str = ""
    lookup_timeout_ms: int = 200
    retry_after_ms: int = 1000
    load_policy: str = "plan"
    prefill_tokens_per_s: float = 0.0
    attention_doubling_tokens: float | None = None
    measure_prefill_rate: bool = False
    io_timeout_ms: int = 60000
    kv_cache_layout: str | None = None
    layerwise_load: bool = False
    layer_group: int = 4
    max_pending_save_chunks: int = 1024
    save_while_running: bool = True
    page_threads: int = 8

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | None,
                     ignore: Sequence[str] = ()) -> ConnectorSettings:
        """Settings from an engine's extra config; keys in ``ignore`` belong to the
        engine. Raises ValueError naming an unknown key or a bad value."""
        config = dict(config or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, value in config.items():
            if name in ignore:
                continue
            if name not in fields:
                raise ValueError(f"kvtier: unknown setting {name!r}; known: {sorted(fields)}")
            want = _SETTING_TYPES.get(name, str)
            if value is not None and (not isinstance(value, want) or
                                      (want is not bool and isinstance(value, bool))):
                raise ValueError(f"kvtier: setting {name!r} must be "
                                 f"{getattr(want, '__name__', 'a number')}, not {value!r}")
            values[name] = value
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.layer_group <= 0:
            raise ValueError(f"kvtier: layer_group must be positive, not {self.layer_group}")
        if not 1 <= self.page_threads <= 64:
            raise ValueError(f"kvtier: page_threads must be in [1, 64], not {self.page_threads}")
        if self.max_pending_save_chunks < 0:
            raise ValueError("kvtier: max_pending_save_chunks must not be negative")
        if self.chunk_tokens <= 0:
            raise ValueError(f"kvtier: chunk_tokens must be positive, not {self.chunk_tokens}")
        if self.lookup_timeout_ms <= 0 or self.io_timeout_ms <= 0 or self.retry_after_ms < 0:
            raise ValueError("kvtier: lookup_timeout_ms and io_timeout_ms must be positive, "
                             "retry_after_ms not negative")
        if self.load_policy not in ("plan", "all"):
            raise ValueError("kvtier: load_policy must be 'plan' or 'all', not "
                             f"{self.load_policy!r}")
        if self.prefill_tokens_per_s < 0:
            raise ValueError("kvtier: prefill_tokens_per_s must not be negative")
        if self.attention_doubling_tokens is not None and \
                not (math.isfinite(self.attention_doubling_tokens)
                     and self.attention_doubling_tokens >= 0):
            raise ValueError("kvtier: attention_doubling_tokens must be a finite number of "
                             f"tokens >= 0 (0: linear), not {self.attention_doubling_tokens}")
        if self.kv_cache_layout is not None and \
                self.kv_cache_layout not in STACKED_LAYOUTS + SEPARATE_LAYOUTS + (PACKED_LAYOUT,):
            raise ValueError(f"kvtier: kv_cache_layout {self.kv_cache_layout!r} is not one of "
                             f"{(PACKED_LAYOUT,) + STACKED_LAYOUTS + SEPARATE_LAYOUTS}")
        if self.addr is not None and self.socket is not None:
            raise ValueError("kvtier: give socket or addr, not both")

    def connect(self, timeout_ms: int | None = None) -> kvtier.Client:
        """A client of the configured kvtierd (Unavailable if it does not answer)."""
        return kvtier.Client(socket=self.socket, addr=self.addr, token_file=self.token_file,
                             timeout_ms=timeout_ms or self.io_timeout_ms)


def _config_value(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def attention_doubling_tokens(config: Any) -> float:
    """C2 of a decoder-only transformer: the context length, in tokens, at which
    one token's prefill costs twice its short-context cost (the attention term
    of kvtierd's recompute cost, docs/daemon.md "Load or recompute").

    From FLOPs: a token at context position c costs 2*P in the weights (P:
    non-embedding parameters) and 4*L*Hq*D*c in attention (L layers, Hq query
    heads, D head dim: QK^T and the weighted sum of V), so
    C2 = P / (2*L*Hq*D), in which L cancels. P counts per layer the q, k, v and
    o projections, H*Hq*D + 2*H*Hkv*D + Hq*D*H, and a gated MLP, 3*H*I (with
    num_experts_per_tok, that many experts of moe_intermediate_size or
    intermediate_size, plus a shared expert of shared_expert_intermediate_size
    if given). Biases, norms, embeddings and the LM head are left out, and so
    are sliding windows and other attention that stops growing with context.
    Llama-3.1-8B: 26,624 tokens; Qwen2.5-7B: 32,512.

    config: a transformers PretrainedConfig, a dict of config.json, or any
    object with its attributes: hidden_size, num_attention_heads,
    num_key_value_heads (default num_attention_heads), head_dim (default
    hidden_size // num_attention_heads), intermediate_size. A multimodal
    config's text_config is read instead when it has one.
    Raises ValueError naming a missing or non-positive field.
    """
    text = _config_value(config, "text_config")
    if text is not None:
        config = text

    def field(name: str, default: Any = None) -> int:
        value = _config_value(config, name)
        if value is None:
            value = default
        if value is None:
            raise ValueError(f"kvtier: the model config has no {name}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"kvtier: the model config's {name} must be a positive integer, "
                             f"not {value!r}")
        return value

    hidden = field("hidden_size")
    heads = field("num_attention_heads")
    kv_heads = field("num_key_value_heads", heads)
    head_dim = field("head_dim", hidden // heads)
    experts = _config_value(config, "num_experts_per_tok")
    if experts:
        per_expert = field("moe_intermediate_size", _config_value(config, "intermediate_size"))
        mlp = field("num_experts_per_tok") * 3 * hidden * per_expert
        shared = _config_value(config, "shared_expert_intermediate_size")
        if shared:
            mlp += 3 * hidden * field("shared_expert_intermediate_size")
    else:
        mlp = 3 * hidden * field("intermediate_size")
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return (attention + mlp) / (2 * heads * head_dim)


def resolve_attention_doubling_tokens(setting: float | None, config: Any) -> float:
    """``setting`` when it is given (not None), else ``attention_doubling_tokens(config)``
    of the model's config, or 0 (a linear recompute cost) when there is no config or it
    does not tell (logged)."""
    if setting is not None:
        return float(setting)
    if config is None:
        return 0.0
    try:
        return attention_doubling_tokens(config)
    except ValueError as e:
        logger.info("kvtier: %s; the load plan prices recompute linearly in tokens "
                    "(set attention_doubling_tokens)", e)
        return 0.0


def engine_identity(model_id: str, dtype: torch.dtype | str, codec: str = "k16v8", *,
                    revision: str = "", tp_world_size: int = 1,
                    tp_rank: int = 0) -> kvtier.ModelIdentity:
    """The identity an engine's chunk keys derive from (kv_layout ``KV_LAYOUT``).

    dtype: the KV cache's 16-bit dtype (torch.bfloat16 / torch.float16 or
    "bf16" / "fp16"); other KV dtypes raise ValueError.
    """
    name = DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in ("bf16", "fp16"):
        raise ValueError(f"kvtier caches 16-bit KV (bfloat16 or float16), not {dtype}")
    if not model_id:
        raise ValueError("kvtier: the model id is empty; set model_id")
    return kvtier.ModelIdentity(model_id=str(model_id), revision=str(revision or ""), dtype=name,
                                kv_layout=KV_LAYOUT, codec=codec, tp_world_size=int(tp_world_size),
                                tp_rank=int(tp_rank))


def token_array(token_ids) -> array.array:
    """Token ids as array('I'), which kvtier.chunk_keys reads without conversion."""
    if isinstance(token_ids, array.array) and token_ids.typecode == "I":
        return token_ids
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    try:
        return array.array("I", token_ids)
    except OverflowError:
        raise ValueError("token ids must be integers in [0, 2^32)") from None


# ---- lookups ---------------------------------------------------------------------------


class BoundedLookup:
    """kvtierd's load plan within a deadline, for a caller that must not wait
    (an engine's scheduler).

    ``plan`` returns None (a miss) when kvtierd does not answer within
    ``timeout_ms``, cannot be reached or fails; for ``retry_after_ms`` after
    that every call is a miss without asking, and while an earlier call is
    still stuck in kvtierd no new one is started. The client connects in the
    background from construction on (the first call waits for that within its
    deadline), and again on the call after a failure. Thread-safe.
    """

    def __init__(self, connect: Callable[[int], kvtier.Client], timeout_ms: int,
                 retry_after_ms: int = 1000, clock: Callable[[], float] = time.monotonic):
        self._connect = connect
        self._timeout_s = timeout_ms / 1000.0
        self._timeout_ms = timeout_ms
        self._retry_s = retry_after_ms / 1000.0
        self._clock = clock
        self._mu = threading.Lock()
        self._client: kvtier.Client | None = None
        self._pending: concurrent.futures.Future | None = None
        self._down_until = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-lookup")
        #: misses by cause: "timeout", "error", "backoff", "busy".
        self.misses: dict = {"timeout": 0, "error": 0, "backoff": 0, "busy": 0}
        self._warming: concurrent.futures.Future | None = self._pool.submit(self._warm_up)
        self._pending = self._warming

    def _warm_up(self) -> None:
        try:
            self._client = self._connect(self._timeout_ms)
        except (kvtier.KvtierError, OSError) as e:
            logger.warning("kvtier: cannot reach kvtierd yet (%s); lookups retry", e)

    def _run(self, keys, prefill_tokens_per_s, tokens_per_chunk,
             attention_doubling_tokens) -> kvtier.LoadPlan:
        client = self._client
        if client is None:
            client = self._client = self._connect(self._timeout_ms)
        return client.plan_load(keys, prefill_tokens_per_s, tokens_per_chunk,
                                attention_doubling_tokens)

    def _fail(self, cause: str, error: BaseException | None) -> None:
        self.misses[cause] += 1
        self._down_until = self._clock() + self._retry_s
        if error is not None:
            logger.warning("kvtier lookup failed (%s); counting misses for %.1fs", error,
                           self._retry_s)
            client, self._client = self._client, None
            if client is not None:
                client.close()

    def plan(self, keys: Sequence, prefill_tokens_per_s: float = 0.0,
             tokens_per_chunk: int = 256,
             attention_doubling_tokens: float = 0.0) -> kvtier.LoadPlan | None:
        """The load plan of ``keys`` (``kvtier.Client.plan_load``), or None for a miss
        (see the class comment)."""
        if not keys:
            return None
        deadline = self._clock() + self._timeout_s
        warming = self._warming
        if warming is not None:
            concurrent.futures.wait([warming], timeout=self._timeout_s)
            self._warming = None
        with self._mu:
            if self._pending is not None and not self._pending.done():
                self.misses["busy"] += 1
                return None
            if self._clock() < self._down_until:
                self.misses["backoff"] += 1
                return None
            fut = self._pending = self._pool.submit(self._run, list(keys),
                                                    prefill_tokens_per_s, tokens_per_chunk,
                                                    attention_doubling_tokens)
        try:
            result = fut.result(timeout=max(0.0, deadline - self._clock()))
        except concurrent.futures.TimeoutError:
            with self._mu:
                self.misses["timeout"] += 1
                self._down_until = self._clock() + self._retry_s
            logger.warning("kvtier lookup took over %d ms; counting misses", self._timeout_ms)
            return None
        except (kvtier.KvtierError, OSError) as e:
            with self._mu:
                self._fail("error", e)
            return None
        return result

    def close(self) -> None:
        """Stops the lookup thread (without waiting for a call stuck in kvtierd)."""
        self._pool.shutdown(wait=False)
        with self._mu:
            pending = self._pending
            if pending is None or pending.done():
                client, self._client = self._client, None
                if client is not None:
                    client.close()


def loadable_chunks(plan: kvtier.LoadPlan | None, settings: ConnectorSettings,
                    num_tokens: int, prefill_tokens_per_s: float | None = None) -> int:
    """Leading chunks of a prompt of ``num_tokens`` to load under ``plan``,
    which was made at ``prefill_tokens_per_s`` (default: the settings').

    At most (num_tokens - 1) // chunk_tokens: the prompt's last token always
    runs, since its logits are the prefill's output.
    """
    if plan is None:
        return 0
    rate = settings.prefill_tokens_per_s if prefill_tokens_per_s is None else prefill_tokens_per_s
    chunks = plan.hits
    if settings.load_policy == "plan" and rate > 0:
        chunks = plan.load_chunks
    return max(0, min(chunks, (num_tokens - 1) // settings.chunk_tokens))


class PrefillRateMeter:
    """An engine's prefill rate at short context, measured from its steps.

    ``step(spans)`` is called as each scheduling step starts, with the token
    spans it runs: (first context position, tokens) per request. The time to
    the next call is that step's time; a step of at least ``min_tokens``
    tokens that the next one followed within ``max_gap_s`` (the engine did not
    go idle in between) gives a sample: its tokens, each weighted by
    1 + position / C2 as the plan prices them (C2 =
    ``attention_doubling_tokens``; 0: unweighted), over its time. ``rate()`` is
    the median of the last ``window`` samples, 0 until there are
    ``min_samples``. Steps that also decode count their decode tokens, so on a
    busy engine the rate errs low: the plan then loads more. Not thread-safe.
    """

    def __init__(self, attention_doubling_tokens: float, min_tokens: int, window: int = 32,
                 min_samples: int = 8, max_gap_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self._c2 = float(attention_doubling_tokens)
        self._min_tokens = min_tokens
        self._min_samples = min_samples
        self._max_gap_s = max_gap_s
        self._clock = clock
        self._samples: collections.deque[float] = collections.deque(maxlen=window)
        self._last: tuple[int, float, float] | None = None  # tokens, weighted, start

    def step(self, spans: Iterable[tuple[int, int]]) -> None:
        now = self._clock()
        tokens = 0
        weighted = 0.0
        for first, n in spans:
            tokens += n
            weighted += n * (1 + (first + n / 2) / self._c2) if self._c2 > 0 else n
        if self._last is not None:
            last_tokens, last_weighted, start = self._last
            dt = now - start
            if last_tokens >= self._min_tokens and 0 < dt <= self._max_gap_s:
                self._samples.append(last_weighted / dt)
        self._last = (tokens, weighted, now) if tokens else None

    def rate(self) -> float:
        if len(self._samples) < self._min_samples:
            return 0.0
        return float(statistics.median(self._samples))


# ---- an engine's paged KV ---------------------------------------------------------------


def infer_layout(layer) -> str:
    """The layout of one layer's KV (STACKED_LAYOUTS / SEPARATE_LAYOUTS) from
    its type and shape, as vLLM hands it over (logical NHD shapes).
    Raises ValueError when the shape does not tell."""
    if isinstance(layer, (tuple, list)):
        return "nhd"
    if isinstance(layer, torch.Tensor) and layer.dim() == 4:
        return PACKED_LAYOUT
    if not isinstance(layer, torch.Tensor) or layer.dim() != 5:
        raise ValueError(f"a layer's KV must be a 4-D tensor (K and V packed), a 5-D tensor "
                         f"or a (K, V) pair, not {getattr(layer, 'shape', type(layer).__name__)}")
    first, second = layer.shape[0] == 2, layer.shape[1] == 2
    if first and not second:
        return "flash_attn_nhd"
    if second and not first:
        return "flashinfer_nhd"
    raise ValueError(f"cannot tell the KV layout of shape {tuple(layer.shape)}; set "
                     f"kv_cache_layout to one of {STACKED_LAYOUTS}")


class PagedKv:
    """An engine's paged KV cache, one entry per layer, in one layout.

    layers: per layer a 4-D tensor (the packed layout), a 5-D tensor (stacked
    layouts) or a (K, V) pair of 4-D tensors (separate layouts), BF16 or FP16,
    all of one shape, dtype and device. Holds references to the tensors; reads
    and writes them in place. ``k[l]`` / ``v[l]`` are views [num_blocks,
    block_size, kv_heads, head_dim].
    head_dim: the model's head size, checked against a packed layer's last
    dimension (2 * head_dim); None takes half of it.
    """

    def __init__(self, layers: Sequence, layout: str | None = None,
                 head_dim: int | None = None):
        layers = list(layers)
        if not layers:
            raise ValueError("the KV cache has no layers")
        self.layout = layout or infer_layout(layers[0])
        self.layers = layers
        self._packed_head_dim = head_dim
        self.k, self.v = [], []
        for i, layer in enumerate(layers):
            k, v = self._views(layer, i)
            self.k.append(k)
            self.v.append(v)
        ref = self.k[0]
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            for t in (k, v):
                if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
                    raise ValueError(f"layer {i}: {tuple(t.shape)} {t.dtype} {t.device} differs "
                                     f"from layer 0: {tuple(ref.shape)} {ref.dtype} {ref.device}")
        if ref.dtype not in DTYPE_NAMES:
            raise ValueError(f"kvtier caches BF16/FP16 KV, not {ref.dtype}")
        self.num_layers = len(layers)
        self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = ref.shape
        self.dtype = ref.dtype
        self.device = ref.device
        self._gpu_cache: kvtorch.PagedCache | None = None

    def _views(self, layer, i: int):
        layout = self.layout
        if layout == PACKED_LAYOUT:
            if not isinstance(layer, torch.Tensor) or layer.dim() != 4:
                raise ValueError(f"layout packed: layer {i} must be a 4-D tensor [blocks, "
                                 f"kv_heads, block_size, 2 * head_dim]")
            width = layer.shape[3]
            d = self._packed_head_dim or width // 2
            if width != 2 * d:
                raise ValueError(f"layout packed: layer {i}'s last dimension is {width}, not "
                                 f"2 * head_dim {d} (K and V of one head size)")
            k, v = layer[..., :d], layer[..., d:]
            return k.transpose(1, 2), v.transpose(1, 2)
        if layout in SEPARATE_LAYOUTS:
            if not isinstance(layer, (tuple, list)) or len(layer) != 2:
                raise ValueError(f"layout {layout}: layer {i} must be a (K, V) pair")
            k, v = layer
            for t in (k, v):
                if not isinstance(t, torch.Tensor) or t.dim() != 4:
                    raise ValueError(f"layout {layout}: layer {i} needs 4-D K and V tensors")
            if layout == "hnd":
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            return k, v
        if layout not in STACKED_LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}")
        if not isinstance(layer, torch.Tensor) or layer.dim() != 5:
            raise ValueError(f"layout {layout}: layer {i} must be a 5-D tensor")
        axis = 0 if layout.startswith("flash_attn") else 1
        if layer.shape[axis] != 2:
            raise ValueError(f"layout {layout}: dimension {axis} of layer {i} must be 2 (K, V), "
                             f"shape {tuple(layer.shape)}")
        k, v = layer.select(axis, 0), layer.select(axis, 1)
        if layout.endswith("hnd"):
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k, v

    def check_blocks(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """block_ids as a tensor; ValueError unless they are in range and hold num_tokens."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if ids.numel() * self.block_size != num_tokens:
            raise ValueError(f"{ids.numel()} blocks of {self.block_size} tokens do not hold "
                             f"{num_tokens} tokens")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block ids {ids.tolist()} are outside [0, {self.num_blocks})")
        return ids

    def gather(self, block_ids: Sequence[int]):
        """K and V of the tokens in ``block_ids`` (in order), CPU tensors
        [layers, tokens, kv_heads, head_dim], contiguous."""
        ids = self.check_blocks(block_ids, len(block_ids) * self.block_size).to(self.device)
        shape = (len(ids) * self.block_size, self.num_kv_heads, self.head_dim)
        k = torch.stack([t.index_select(0, ids).reshape(shape) for t in self.k])
        v = torch.stack([t.index_select(0, ids).reshape(shape) for t in self.v])
        return k.cpu().contiguous(), v.cpu().contiguous()

    def scatter(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor,
                layers: tuple | None = None) -> None:
        """Writes K and V [layers, tokens, kv_heads, head_dim] into ``block_ids``
        (whole blocks; ``layers`` = (begin, end) of the cache the rows are)."""
        begin, end = layers or (0, self.num_layers)
        ids = self.check_blocks(block_ids, k.shape[1]).to(self.device)
        shape = (len(ids), self.block_size, self.num_kv_heads, self.head_dim)
        for i, layer in enumerate(range(begin, end)):
            self.k[layer][ids] = k[i].reshape(shape).to(self.device)
            self.v[layer][ids] = v[i].reshape(shape).to(self.device)

    def gpu_cache(self):
        """The kvtier.torch.PagedCache over the same tensors (CUDA only), made once."""
        if self._gpu_cache is None:
            if self.layout in STACKED_LAYOUTS:
                self._gpu_cache = kvtorch.PagedCache.from_vllm(self.layers, layout=self.layout)
            elif self.layout == PACKED_LAYOUT:
                # K and V [blocks, kv_heads, block_size, head_dim] views, one set of strides.
                self._gpu_cache = kvtorch.PagedCache.from_separate(
                    [k.transpose(1, 2) for k in self.k], [v.transpose(1, 2) for v in self.v],
                    layout="hnd")
            else:
                self._gpu_cache = kvtorch.PagedCache.from_separate(
                    [k for k, _ in self.layers], [v for _, v in self.layers], layout=self.layout)
        return self._gpu_cache

    def close(self) -> None:
        """Frees libkvtier's descriptor of the tensors (``gpu_cache``), if one
        was made; a later ``gpu_cache()`` makes a new one.
        REQUIRES: no queued work uses the descriptor."""
        cache, self._gpu_cache = self._gpu_cache, None
        if cache is not None:
            cache.close()


# ---- the mover ------------------------------------------------------------------------------


@dataclasses.dataclass
class LoadResult:
    """How a load of chunks went: ``tiers[i]`` is chunk i's tier, or None when it
    could not be used (``errors[i]``: the reason); its blocks hold no valid KV."""
    tiers: list
    errors: list

    @property
    def failed(self) -> list:
        """Indices of the chunks that could not be used."""
        return [i for i, t in enumerate(self.tiers) if t is None]


class PendingLoad:
    """Chunks being loaded into a PagedKv; ``wait_layer(l)`` before layer l is
    read, ``finish()`` once for the result. On the CPU path every layer is in
    place when the load is created; on the GPU path layers arrive on the device
    and ``wait_layer`` makes the current stream wait for layer l."""

    def __init__(self, result: LoadResult | None = None, layerwise=None, n: int = 0):
        self._result = result
        self._layerwise = layerwise
        self._n = n

    def wait_layer(self, layer: int) -> None:
        if self._layerwise is not None:
            self._layerwise.wait_layer(layer)

    def finish(self) -> LoadResult:
        if self._result is None:
            tiers = self._layerwise.finish()
            codes = self._layerwise.statuses or [0] * self._n
            errors = [None if t is not None else f"status {c}"
                      for t, c in zip(tiers, codes, strict=True)]
            self._result = LoadResult(list(tiers), errors)
        return self._result


class KvMover:
    """Stores and loads chunks between kvtierd and an engine's PagedKv.

    client: a connected kvtier.Client; identity: the engine's
    ``engine_identity``; chunk_tokens: a multiple of the cache's block size.
    CPU caches go through the CPU codec, CUDA caches through kvtier's GPU path
    (a libkvtier built with CUDA). Not thread-safe; one mover per thread.
    """

    def __init__(self, client: kvtier.Client, kv: PagedKv, identity: kvtier.ModelIdentity,
                 chunk_tokens: int, codec: str | None = None):
        if chunk_tokens <= 0 or chunk_tokens % kv.block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a positive multiple of the "
                             f"block size {kv.block_size}")
        if identity.dtype != DTYPE_NAMES[kv.dtype]:
            raise ValueError(f"the identity's dtype {identity.dtype} is not the cache's {kv.dtype}")
        self.client = client
        self.kv = kv
        self.identity = identity
        self.codec = codec or identity.codec
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // kv.block_size
        self.fingerprint = identity.fingerprint()
        self.on_gpu = kv.device.type == "cuda"
        self._side = torch.cuda.Stream(kv.device) if self.on_gpu else None
        if self.on_gpu:
            # The pool's CUDA registration stalls the engine's CUDA calls for
            # seconds: at start, not at the first store between requests.
            took = kvtorch.open_gpu(client, kv.device)
            if took >= 1.0:
                logger.warning("kvtier: registering kvtierd's pool with CUDA for %s took %.1f s "
                               "(once, at start)", kv.device, took)

    def chunk_blocks(self, block_ids: Sequence[int], chunk: int) -> list:
        """The block ids of chunk ``chunk`` among a request's blocks (from token 0)."""
        b = chunk * self.blocks_per_chunk
        ids = list(block_ids[b:b + self.blocks_per_chunk])
        if len(ids) != self.blocks_per_chunk:
            raise ValueError(f"chunk {chunk} needs blocks [{b}, {b + self.blocks_per_chunk}) "
                             f"of a request that has {len(block_ids)}")
        return ids

    def save(self, key, block_ids: Sequence[int], durable: bool = False, stream=None) -> None:
        """Stores the chunk in ``block_ids`` (chunk_tokens tokens) as ``key``.
        Raises KvtierError from kvtierd, ValueError for bad block ids."""
        self.kv.check_blocks(block_ids, self.chunk_tokens)
        if self.on_gpu:
            kvtorch.store(self.client, key, self.kv.gpu_cache(), list(block_ids), self.codec,
                          fingerprint=self.fingerprint, stream=stream, durable=durable)
            return
        k, v = self.kv.gather(block_ids)
        chunk = kvtorch.encode_chunk(self.fingerprint, k, v, self.codec, self.kv.block_size)
        self.client.put(key, chunk, durable=durable)

    def save_many(self, keys: Sequence, block_ids_per_key: Sequence[Sequence[int]],
                  durable: bool = False, stream=None) -> list:
        """``save`` of many chunks: one entry per chunk, None if stored, else
        the KvtierError or ValueError that stopped it (a failed chunk does not
        stop the others). CUDA caches store them in one call into libkvtier
        (kvtier.torch.store_batch), which encodes the next chunks while
        kvtierd commits the earlier ones."""
        keys = list(keys)
        per = [list(ids) for ids in block_ids_per_key]
        if len(keys) != len(per):
            raise ValueError("one block id list per key")
        out: list = [None] * len(keys)
        good = []
        for i, ids in enumerate(per):
            try:
                self.kv.check_blocks(ids, self.chunk_tokens)
                good.append(i)
            except ValueError as e:
                out[i] = e
        if not self.on_gpu:
            for i in good:
                try:
                    self.save(keys[i], per[i], durable=durable)
                except kvtier.KvtierError as e:
                    out[i] = e
            return out
        if good:
            errors = kvtorch.store_batch(self.client, [keys[i] for i in good], self.kv.gpu_cache(),
                                         [per[i] for i in good], self.codec,
                                         fingerprint=self.fingerprint, stream=stream,
                                         durable=durable)
            for i, err in zip(good, errors, strict=True):
                out[i] = err
        return out

    def _check_chunk(self, info) -> None:
        kv = self.kv
        want = (self.fingerprint, kv.num_layers, kv.num_kv_heads, kv.head_dim, self.chunk_tokens,
                DTYPE_NAMES[kv.dtype])
        got = (info.fingerprint, info.num_layers, info.num_kv_heads, info.head_dim,
               info.num_tokens, info.dtype)
        if want != got:
            raise kvtier.InvalidArgument(3, f"chunk geometry {got[1:]} (or model) is not the "
                                            f"cache's {want[1:]}")

    def load(self, keys: Sequence, block_ids_per_key: Sequence[Sequence[int]],
             layer_group: int = 4) -> PendingLoad:
        """Starts loading chunk ``keys[i]`` into ``block_ids_per_key[i]``.

        A chunk that is missing, corrupt (DataLoss; kvtierd drops it) or of
        another model or geometry is reported by ``finish()`` and leaves its
        blocks unspecified: the caller recomputes them. The CPU path verifies
        each chunk before anything is written.
        """
        keys = list(keys)
        if len(keys) != len(block_ids_per_key):
            raise ValueError("one block id list per key")
        for ids in block_ids_per_key:
            self.kv.check_blocks(ids, self.chunk_tokens)
        if not keys:
            return PendingLoad(LoadResult([], []))
        if self._side is not None:  # a CUDA cache
            # The decode runs on a side stream, after the work already queued on the
            # current one (which may still read the blocks' previous contents), so it
            # overlaps the forward; wait_layer makes the current stream wait per layer.
            self._side.wait_stream(torch.cuda.current_stream(self.kv.device))
            lw = kvtorch.load_layerwise(self.client, keys, self.kv.gpu_cache(),
                                        [list(ids) for ids in block_ids_per_key],
                                        layer_group=layer_group, stream=self._side)
            return PendingLoad(layerwise=lw, n=len(keys))
        tiers: list[str | None] = []
        errors: list[str | None] = []
        for key, ids in zip(keys, block_ids_per_key, strict=True):
            try:
                with self.client.get(key) as chunk:
                    self._check_chunk(kvtier.codec.read_header(chunk.data))
                    k, v = kvtorch.decode_chunk(chunk.data)
                self.kv.scatter(ids, k, v)
                tiers.append(chunk.tier)
                errors.append(None)
            except UNUSABLE as e:
                tiers.append(None)
                errors.append(str(e))
        return PendingLoad(LoadResult(tiers, errors))


__all__ = ["KV_LAYOUT", "DTYPE_NAMES", "STACKED_LAYOUTS", "SEPARATE_LAYOUTS", "PACKED_LAYOUT",
           "UNUSABLE", "ConnectorSettings", "attention_doubling_tokens",
           "resolve_attention_doubling_tokens", "engine_identity", "token_array", "BoundedLookup",
           "loadable_chunks", "PrefillRateMeter", "infer_layout", "PagedKv", "LoadResult",
           "PendingLoad", "KvMover"]

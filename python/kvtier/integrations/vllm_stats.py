"""kvtier's counters in vLLM's KV transfer metrics.

A worker's connector counts what it stored, skipped and loaded; vLLM collects
the counts of every worker each step (``get_kv_connector_stats``), logs them
with its periodic stats ("KV Transfer metrics: ...") and exports them to
Prometheus as ``vllm:kvtier_*`` counters with the engine's labels.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# name: (Prometheus counter, its help)
COUNTERS = {
    "chunks_stored": ("vllm:kvtier_chunks_stored", "Chunks the connector stored in kvtierd."),
    "chunks_store_skipped": (
        "vllm:kvtier_chunks_store_skipped",
        "Chunks not stored because the save queue was full (max_pending_save_chunks)."),
    "store_errors": ("vllm:kvtier_store_errors", "Requests whose store failed (not retried)."),
    "store_seconds": ("vllm:kvtier_store_seconds",
                      "Seconds the connector's saver spent storing (encode, copy, commit)."),
    "store_block_seconds": (
        "vllm:kvtier_store_block_seconds",
        "GPU KV blocks times the seconds a finished request's blocks were kept for its "
        "stores, from its last save's submission to the end of its saves, summed over "
        "workers (its rate is the blocks the stores keep from the cache on average)."),
    "chunks_loaded": ("vllm:kvtier_chunks_loaded", "Chunks loaded from kvtierd."),
    "load_errors": ("vllm:kvtier_load_errors",
                    "Chunks that failed to load and were recomputed."),
}


@dataclasses.dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Counts over one interval, keyed as COUNTERS; sums across workers."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        fresh: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        self.data = fresh

    def add(self, name: str, value: float) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in COUNTERS:
                self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k in COUNTERS}
        out["store_seconds"] = round(float(out["store_seconds"]), 4)
        out["store_block_seconds"] = round(float(out["store_block_seconds"]), 4)
        if self.data["chunks_stored"]:
            out["store_ms_per_chunk"] = round(
                1e3 * self.data["store_seconds"] / self.data["chunks_stored"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The counters of COUNTERS, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, dict[int, Any]] = {}
        for name, (metric, doc) in COUNTERS.items():
            counter = self._counter_cls(name=metric, documentation=doc, labelnames=labelnames)
            self._children[name] = {idx: counter.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            child = self._children.get(name, {}).get(engine_idx)
            if child is not None and value:
                child.inc(value)


__all__ = ["COUNTERS", "KvtierConnectorStats", "KvtierPromMetrics"]

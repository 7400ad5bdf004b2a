"""Prometheus metrics of one gateway app, in its own CollectorRegistry (never the global one,
so that several apps, e.g. in tests, do not share counters).

Request counters and latency histograms are updated as requests run; worker gauges (queue
depth, KV blocks, ready workers) are refreshed from the worker registry at scrape time, which
also drops the labels of workers that left.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from services.gateway.workers import WorkerRegistry
from shared.protocol import Histogram as WireHistogram

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)


class _RestoreHistograms:
    """`skiff_kv_restore_seconds`: each worker's KV tier restore times as its last heartbeat
    gave them (histograms the worker keeps; `render` hands over the set to expose)."""

    def __init__(self) -> None:
        self.latest: list[tuple[str, str, WireHistogram]] = []  # (worker, stage, histogram)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "skiff_kv_restore_seconds",
            "KV tier restores per worker, from heartbeats: stage latency (lookup sent to the "
            "blocks in the KV pool), stage copy (the RAM tier -> pool copies alone)",
            labels=["worker", "stage"],
        )
        for worker, stage, h in self.latest:
            buckets, total = [], 0
            for le, n in zip([*h.le, float("inf")], h.counts, strict=True):
                total += n
                buckets.append((floatToGoString(le), total))
            family.add_metric([worker, stage], buckets, h.sum)
        yield family


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "skiff_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "skiff_prompt_tokens", "prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            "skiff_generation_tokens", "tokens generated (stop tokens included)", registry=r
        )
        self.ttft = Histogram(
            "skiff_time_to_first_token_seconds",
            "request arrival to first generated token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "skiff_inter_token_latency_seconds",
            "time between consecutive tokens of one request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "skiff_queue_depth", "requests waiting in workers (from heartbeats)", registry=r
        )
        self.kv_used = Gauge(
            "skiff_kv_blocks_used", "KV blocks in use per worker", ["worker"], registry=r
        )
        self.kv_free = Gauge(
            "skiff_kv_blocks_free", "free KV blocks per worker", ["worker"], registry=r
        )
        self.kv_tiers = Gauge(
            "skiff_kv_tier_events",
            "KV tier events per worker since it started (stored, restored, restored_bytes, "
            "lookups, timeouts, mismatches, no_slot, resumed: preempted sequences looked up; "
            "restore_us: the restores' copy time), from heartbeats",
            ["worker", "event"],
            registry=r,
        )
        self.spec = Gauge(
            "skiff_spec_tokens",
            "speculative decoding per worker since it started, from heartbeats: verified steps "
            "(event steps) and draft tokens proposed and accepted by proposer (event drafted, "
            "accepted; source prompt, table, draft)",
            ["worker", "event", "source"],
            registry=r,
        )
        self.grammar = Gauge(
            "skiff_grammar",
            "structured output per worker since it started, from heartbeats: steps that masked "
            "logits (event steps), masked rows (rows), host microseconds filling the masks "
            "(fill_us), applying them (apply_us) and waiting first for the tokens of the step "
            "in flight (catch_up_us)",
            ["worker", "event"],
            registry=r,
        )
        self.moves = Gauge(
            "skiff_request_moves",
            "requests moved between workers since the gateway started: handed_on (prefilled "
            "by a prefill worker, decoded by a decode worker), prefill_lost (moved on when "
            "their prefill worker died)",
            ["event"],
            registry=r,
        )
        self.workers_ready = Gauge(
            "skiff_workers_ready", "workers ready to take requests", registry=r
        )
        self.kv_restore = _RestoreHistograms()
        r.register(self.kv_restore)

    def render(self, workers: WorkerRegistry, moves: dict[str, int] | None = None) -> bytes:
        """The exposition text, with worker gauges (and the router's move counts) as of now."""
        for event, n in (moves or {}).items():
            self.moves.labels(event=event).set(n)
        self.kv_used.clear()
        self.kv_free.clear()
        self.kv_tiers.clear()
        self.spec.clear()
        self.grammar.clear()
        waiting = 0
        restores = []
        for w in workers.all_workers():
            hb = w.heartbeat
            if hb is None:
                continue
            waiting += hb.waiting
            self.kv_used.labels(worker=w.worker_id).set(hb.kv_blocks_used)
            self.kv_free.labels(worker=w.worker_id).set(hb.kv_blocks_free)
            for event, n in hb.kv_tiers.items():
                self.kv_tiers.labels(worker=w.worker_id, event=event).set(n)
            for stage, h in hb.kv_restore.items():
                if len(h.counts) == len(h.le) + 1:  # else malformed: not shown
                    restores.append((w.worker_id, stage, h))
            for key, n in hb.spec.items():
                event, _, source = key.partition(":")
                self.spec.labels(worker=w.worker_id, event=event, source=source).set(n)
            for event, n in hb.grammar.items():
                self.grammar.labels(worker=w.worker_id, event=event).set(n)
        self.kv_restore.latest = restores
        self.queue_depth.set(waiting)
        self.workers_ready.set(len(workers.ready_workers()))
        return generate_latest(self.registry)

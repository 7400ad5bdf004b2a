"""The spec service's counters: plain ints the ROUTER loop bumps, read by a Prometheus collector
at scrape time (its own registry, `skiff_spec_*`) and by the periodic one-line summary."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.spec.domain_table import DomainTables
from services.spec.sequences import LiveSequences

SOURCES = ("prompt", "table")  # the proposers this service has (a draft's `source`)


@dataclass
class SpecStats:
    asks: int = 0  # SpecAsk messages
    seqs_asked: int = 0  # SpecSeq items in them
    unknown: int = 0  # items answered as unknown (no copy from their start on)
    ends: int = 0  # sequences a SpecEnd forgot
    malformed: int = 0  # undecodable frames, failed handlers
    drafts: Counter[str] = field(default_factory=Counter)  # by source
    draft_tokens: Counter[str] = field(default_factory=Counter)  # by source


def _table_counts(tables: DomainTables | None) -> tuple[int, int, int, int]:
    """n-grams, sequences learned, sequences dropped (a full queue), entries pruned."""
    if tables is None or not tables.enabled:
        return (0, 0, 0, 0)
    return (tables.ngrams, tables.learned, tables.dropped, tables.pruned)


def snapshot(stats: SpecStats, seqs: LiveSequences, tables: DomainTables | None) -> tuple:
    s = stats
    base = (s.asks, s.seqs_asked, s.unknown, s.ends, s.malformed, len(seqs), seqs.evicted)
    return base + _table_counts(tables)


def summary(stats: SpecStats, seqs: LiveSequences, tables: DomainTables | None) -> str:
    s = stats
    drafts = ", ".join(f"{src} {s.drafts[src]} ({s.draft_tokens[src]} tokens)" for src in SOURCES)
    ngrams, learned, dropped, pruned = _table_counts(tables)
    return (
        f"spec: {len(seqs)} sequences ({seqs.tokens} tokens, {seqs.evicted} evicted); asks "
        f"{s.asks} for {s.seqs_asked} sequences; drafts {drafts}; unknown {s.unknown}; ended "
        f"{s.ends}; tables {ngrams} n-grams, learned {learned} dropped {dropped} pruned "
        f"{pruned}; malformed {s.malformed}"
    )


class SpecCollector:
    def __init__(
        self, stats: SpecStats, seqs: LiveSequences, tables: DomainTables | None = None
    ) -> None:
        self.stats, self.seqs, self.tables = stats, seqs, tables

    def collect(self) -> Iterator[Metric]:
        s, seqs = self.stats, self.seqs
        ngrams, learned, dropped, pruned = _table_counts(self.tables)
        yield GaugeMetricFamily("skiff_spec_sequences", "live sequences held", value=len(seqs))
        yield GaugeMetricFamily("skiff_spec_tokens", "tokens held in all", value=seqs.tokens)
        yield GaugeMetricFamily("skiff_spec_table_ngrams", "domain table entries", value=ngrams)
        drafts = CounterMetricFamily("skiff_spec_drafts", "drafts sent", labels=["source"])
        tokens = CounterMetricFamily(
            "skiff_spec_draft_tokens", "tokens in the drafts sent", labels=["source"]
        )
        for src in SOURCES:
            drafts.add_metric([src], s.drafts[src])
            tokens.add_metric([src], s.draft_tokens[src])
        yield drafts
        yield tokens
        for name, doc, value in (
            ("asks", "SpecAsk messages", s.asks),
            ("seqs_asked", "sequences in them", s.seqs_asked),
            ("unknown", "sequences answered unknown (resend whole)", s.unknown),
            ("ends", "sequences forgotten by a SpecEnd", s.ends),
            ("evicted", "sequences evicted by the bound", seqs.evicted),
            ("malformed", "malformed messages ignored", s.malformed),
            ("table_learned", "finished sequences counted into a table", learned),
            ("table_dropped", "finished sequences not counted (a full queue)", dropped),
            ("table_pruned", "table entries dropped by the halvings", pruned),
        ):
            yield CounterMetricFamily(f"skiff_spec_{name}", doc, value=value)


def serve_metrics(
    port: int, stats: SpecStats, seqs: LiveSequences, tables: DomainTables | None
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SpecCollector(stats, seqs, tables))
    start_http_server(port, addr="127.0.0.1", registry=registry)
    return registry

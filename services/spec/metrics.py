"""The spec service's counters: plain ints the ROUTER loop bumps, read by a Prometheus collector
at scrape time (its own registry, `skiff_spec_*`) and by the periodic one-line summary; with a
draft model, its steps and their time too (`skiff_spec_draft_step_seconds`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from services.spec.domain_table import DomainTables
from services.spec.sequences import LiveSequences

if TYPE_CHECKING:
    from services.spec.draft_model import DraftModel

SOURCES = ("prompt", "table", "draft")  # the proposers this service has (a draft's `source`)


@dataclass
class SpecStats:
    asks: int = 0  # SpecAsk messages
    seqs_asked: int = 0  # SpecSeq items in them
    unknown: int = 0  # items answered as unknown (no copy from their start on)
    ends: int = 0  # sequences a SpecEnd forgot
    malformed: int = 0  # undecodable frames, failed handlers
    draft_errors: int = 0  # asks the draft model failed on (answered without it)
    drafts: Counter[str] = field(default_factory=Counter)  # by source
    draft_tokens: Counter[str] = field(default_factory=Counter)  # by source


def _table_counts(tables: DomainTables | None) -> tuple[int, int, int, int]:
    """n-grams, sequences learned, sequences dropped (a full queue), entries pruned."""
    if tables is None or not tables.enabled:
        return (0, 0, 0, 0)
    return (tables.ngrams, tables.learned, tables.dropped, tables.pruned)


def _draft_counts(draft: DraftModel | None) -> tuple[int, float, int, int, int, int]:
    """The draft model's forwards, their seconds, tokens fed, guesses reused, states evicted,
    asks too long for it (zeros without one)."""
    if draft is None:
        return (0, 0.0, 0, 0, 0, 0)
    d = draft.stats
    return (d.forwards, d.seconds, d.fed, d.reused, d.evicted, d.too_long)


def snapshot(
    stats: SpecStats,
    seqs: LiveSequences,
    tables: DomainTables | None,
    draft: DraftModel | None = None,
) -> tuple:
    s = stats
    base = (s.asks, s.seqs_asked, s.unknown, s.ends, s.malformed, len(seqs), seqs.evicted)
    return base + _table_counts(tables) + _draft_counts(draft)


def summary(
    stats: SpecStats,
    seqs: LiveSequences,
    tables: DomainTables | None,
    draft: DraftModel | None = None,
) -> str:
    s = stats
    drafts = ", ".join(f"{src} {s.drafts[src]} ({s.draft_tokens[src]} tokens)" for src in SOURCES)
    ngrams, learned, dropped, pruned = _table_counts(tables)
    model = ""
    if draft is not None:
        steps, secs, fed, reused, evicted, too_long = _draft_counts(draft)
        mean_ms = 1e3 * secs / steps if steps else 0.0
        model = (
            f"; draft model {steps} steps ({mean_ms:.1f} ms each), {fed} tokens fed, {reused} "
            f"guesses reused, {len(draft)} sequences held, {evicted} evicted, {too_long} too "
            f"long, {s.draft_errors} failed"
        )
    return (
        f"spec: {len(seqs)} sequences ({seqs.tokens} tokens, {seqs.evicted} evicted); asks "
        f"{s.asks} for {s.seqs_asked} sequences; drafts {drafts}; unknown {s.unknown}; ended "
        f"{s.ends}; tables {ngrams} n-grams, learned {learned} dropped {dropped} pruned "
        f"{pruned}; malformed {s.malformed}{model}"
    )


class SpecCollector:
    def __init__(
        self,
        stats: SpecStats,
        seqs: LiveSequences,
        tables: DomainTables | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.stats, self.seqs, self.tables, self.draft = stats, seqs, tables, draft

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
        if self.draft is not None:
            yield from self._draft_metrics()

    def _draft_metrics(self) -> Iterator[Metric]:
        steps, secs, fed, reused, evicted, too_long = _draft_counts(self.draft)
        yield SummaryMetricFamily(
            "skiff_spec_draft_step_seconds",
            "the draft model's forwards (a prompt piece or a decode step, batched) and their time",
            count_value=steps,
            sum_value=secs,
        )
        yield GaugeMetricFamily(
            "skiff_spec_draft_sequences", "sequences whose K/V the draft holds", len(self.draft)
        )
        for name, doc, value in (
            ("draft_fed_tokens", "tokens the draft model computed", fed),
            ("draft_reused_tokens", "guesses that came true, their K/V kept", reused),
            ("draft_evicted", "draft states dropped for room (recomputed when asked)", evicted),
            ("draft_too_long", "asks too long for the draft's pool or context", too_long),
            ("draft_errors", "asks the draft model failed on", self.stats.draft_errors),
        ):
            yield CounterMetricFamily(f"skiff_spec_{name}", doc, value=value)


def serve_metrics(
    port: int,
    stats: SpecStats,
    seqs: LiveSequences,
    tables: DomainTables | None,
    draft: DraftModel | None = None,
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SpecCollector(stats, seqs, tables, draft))
    start_http_server(port, addr="127.0.0.1", registry=registry)
    return registry

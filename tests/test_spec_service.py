"""The spec service: the socket-free handler (copies kept per worker identity and sequence, cut
and extended, unknown ones, ends, the LRU bound, malformed frames), and one real `python -m
services.spec` process over a DEALER (ready line, drafts, /metrics, SIGTERM). CPU only, fast."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import zmq

from services.spec.domain_table import DomainTables
from services.spec.metrics import SpecCollector, SpecStats, summary
from services.spec.sequences import LiveSequences
from services.spec.service import SpecService
from shared.protocol import (
    SpecAsk,
    SpecDraft,
    SpecDrafts,
    SpecEnd,
    SpecSeq,
    SpecToWorker,
    decoder,
    encoder,
)

ROOT = Path(__file__).resolve().parents[1]
A, B = b"worker-a", b"worker-b"
ENC = encoder()


def _service(max_seqs: int = 16, max_tokens: int = 10_000, max_draft: int = 64) -> SpecService:
    return SpecService(LiveSequences(max_seqs, max_tokens, 2, 4), SpecStats(), max_draft)


def _ask(svc: SpecService, who: bytes, *seqs: SpecSeq) -> SpecDrafts:
    out = svc.handle([who, ENC.encode(SpecAsk(list(seqs)))])
    assert len(out) == 2 and out[0] == who and isinstance(out[1], SpecDrafts)
    return out[1]


def _draft(seq_id: int, at: int, tokens: list[int]) -> SpecDraft:
    return SpecDraft(seq_id, at, tokens, "prompt")


def test_start_zero_records_and_later_asks_extend_or_cut_the_copy() -> None:
    svc = _service()
    got = _ask(svc, A, SpecSeq(1, 0, [1, 2, 3, 4, 9, 1, 2, 3], 3))
    assert got == SpecDrafts([_draft(1, 8, [4, 9, 1])], [])  # 1 2 3 at the start: then 4 9 1
    got = _ask(svc, A, SpecSeq(1, 8, [4], 2))  # the step's token: 1 2 3 4 matched
    assert got == SpecDrafts([_draft(1, 9, [9, 1])], [])
    got = _ask(svc, A, SpecSeq(1, 5, [7, 8, 6], 2))  # rolled back to 5, then 7 8 6: no repeat
    assert got == SpecDrafts([], []) and svc.seqs.tokens == 8
    got = _ask(svc, A, SpecSeq(1, 8, [1, 2], 4))  # 6 1 2 is new, 1 2 follows at 0: 3 4 9 7
    assert got == SpecDrafts([_draft(1, 10, [3, 4, 9, 7])], [])
    got = _ask(svc, A, SpecSeq(1, 0, [5, 6, 5], 4))  # start 0: replaced
    assert got == SpecDrafts([], []) and svc.seqs.tokens == 3
    got = _ask(svc, A, SpecSeq(1, 3, [6], 4))
    assert got == SpecDrafts([_draft(1, 4, [5, 6])], [])  # never past the end
    assert (svc.stats.asks, svc.stats.seqs_asked, svc.stats.unknown) == (6, 6, 0)
    assert svc.stats.drafts["prompt"] == 4 and svc.stats.draft_tokens["prompt"] == 11


def test_unknown_sequences_and_gaps_get_no_draft_and_change_nothing() -> None:
    svc = _service()
    got = _ask(
        svc,
        A,
        SpecSeq(1, 0, [1, 2, 3, 1, 2], 2),
        SpecSeq(2, 4, [1, 2], 2),  # never sent whole
        SpecSeq(1, 9, [3], 2),  # past the end of seq 1's copy (5 tokens): a gap
    )
    assert got == SpecDrafts([_draft(1, 5, [3, 1])], [2, 1])
    assert _ask(svc, B, SpecSeq(1, 5, [3], 2)) == SpecDrafts([], [1])  # another worker's seq 1
    got = _ask(svc, A, SpecSeq(1, 5, [3], 2))  # the copy is as it was before the gap
    assert got == SpecDrafts([_draft(1, 6, [1, 2])], [])
    assert svc.stats.unknown == 3 and len(svc.seqs) == 1


def test_k_zero_records_only_and_k_is_capped() -> None:
    svc = _service(max_draft=3)
    assert _ask(svc, A, SpecSeq(4, 0, [1, 2, 3, 4, 5, 6, 1, 2], 0)) == SpecDrafts([], [])
    assert (A, 4) in svc.seqs and svc.stats.drafts["prompt"] == 0
    got = _ask(svc, A, SpecSeq(4, 8, [], 1000))
    assert got == SpecDrafts([_draft(4, 8, [3, 4, 5])], [])  # max_draft, not k


def test_spec_end_forgets_the_workers_sequences_only() -> None:
    svc = _service()
    _ask(svc, A, SpecSeq(1, 0, [1, 2, 1], 0), SpecSeq(2, 0, [3, 4, 3], 0))
    _ask(svc, B, SpecSeq(1, 0, [5, 6, 5], 0))
    assert svc.handle([A, ENC.encode(SpecEnd([1, 99]))]) == []  # no reply; 99 never existed
    assert svc.stats.ends == 1 and len(svc.seqs) == 2 and svc.seqs.tokens == 6
    assert _ask(svc, A, SpecSeq(1, 3, [2], 2)) == SpecDrafts([], [1])
    assert _ask(svc, B, SpecSeq(1, 3, [6], 2)) == SpecDrafts([_draft(1, 4, [5, 6])], [])


def test_the_least_recently_asked_go_past_the_bounds() -> None:
    svc = _service(max_seqs=2)
    _ask(svc, A, SpecSeq(1, 0, [1, 2, 1], 0), SpecSeq(2, 0, [2, 3, 2], 0))
    _ask(svc, A, SpecSeq(1, 3, [2], 0))  # 1 is now the most recent
    _ask(svc, B, SpecSeq(3, 0, [4], 0))  # over two: 2 goes
    assert (A, 1) in svc.seqs and (A, 2) not in svc.seqs and (B, 3) in svc.seqs
    assert _ask(svc, A, SpecSeq(2, 3, [3], 1)) == SpecDrafts([], [2])
    assert svc.seqs.evicted == 1 and svc.seqs.tokens == 5

    svc = _service(max_tokens=10)
    _ask(svc, A, SpecSeq(1, 0, [1] * 6, 0), SpecSeq(2, 0, [2] * 4, 0))
    assert len(svc.seqs) == 2 and svc.seqs.tokens == 10
    _ask(svc, A, SpecSeq(2, 4, [2], 0))  # 11 tokens: the older goes
    assert (A, 1) not in svc.seqs and svc.seqs.tokens == 5
    _ask(svc, A, SpecSeq(3, 0, [3] * 20, 0))  # alone over the bound: the one asked stays
    assert list(svc.seqs._seqs) == [(A, 3)] and svc.seqs.tokens == 20


def test_malformed_frames_are_counted_and_ignored() -> None:
    svc = _service()
    assert svc.handle([A, b"\xc1garbage"]) == []
    assert svc.handle([A]) == []
    assert svc.handle([A, ENC.encode(SpecDrafts([], []))]) == []  # the other direction's
    assert svc.stats.malformed == 3
    assert _ask(svc, A, SpecSeq(1, 0, [1, 2, 1, 2], 2)) == SpecDrafts([_draft(1, 4, [1, 2])], [])


def test_summary_and_collector_report_the_counts() -> None:
    svc = _service()
    _ask(svc, A, SpecSeq(1, 0, [1, 2, 3, 1, 2], 2), SpecSeq(2, 3, [1], 2))
    line = summary(svc.stats, svc.seqs, None)
    assert "1 sequences (5 tokens, 0 evicted)" in line and "prompt 1 (2 tokens)" in line
    metrics = {m.name: m for m in SpecCollector(svc.stats, svc.seqs).collect()}
    assert metrics["skiff_spec_sequences"].samples[0].value == 1
    assert metrics["skiff_spec_unknown"].samples[0].value == 1
    by_source = {s.labels["source"]: s.value for s in metrics["skiff_spec_draft_tokens"].samples}
    assert by_source == {"prompt": 2, "table": 0, "draft": 0}


def test_a_domain_table_learns_ended_outputs_and_drafts_where_lookup_finds_none(
    tmp_path: Path,
) -> None:
    tables = DomainTables(str(tmp_path), 1000, 2, 4)
    svc = SpecService(LiveSequences(16, 10_000, 2, 4), SpecStats(), 64, tables)
    for sid in (1, 2):  # the same prompt and output twice: seen often enough to be trusted
        _ask(svc, A, SpecSeq(sid, 0, [100, 50, 51], 0, "code"))
        _ask(svc, A, SpecSeq(sid, 3, [5, 6, 7, 8, 9], 0, "code"))
    assert svc.handle([A, ENC.encode(SpecEnd([1, 2]))]) == []
    tables.flush()
    assert tables.learned == 2
    got = _ask(svc, A, SpecSeq(4, 0, [200, 5, 6], 3, "code"))
    assert got == SpecDrafts([SpecDraft(4, 3, [7, 8, 9], "table")], [])
    assert _ask(svc, A, SpecSeq(5, 0, [200, 5, 6], 3)) == SpecDrafts([], [])  # no domain
    assert _ask(svc, A, SpecSeq(6, 0, [200, 5, 6], 3, "prose")) == SpecDrafts([], [])
    assert _ask(svc, A, SpecSeq(7, 0, [100, 50], 3, "code")) == SpecDrafts([], [])  # a prompt
    got = _ask(svc, A, SpecSeq(8, 0, [5, 6, 1, 2, 5, 6], 3, "code"))  # its own tokens first
    assert got == SpecDrafts([_draft(8, 6, [1, 2, 5])], [])
    assert svc.stats.drafts == {"table": 1, "prompt": 1}
    assert svc.stats.draft_tokens["table"] == 3
    tables.close()


def test_an_evicted_sequence_teaches_nothing(tmp_path: Path) -> None:
    tables = DomainTables(str(tmp_path), 1000, 2, 4)
    svc = SpecService(LiveSequences(1, 10_000, 2, 4), SpecStats(), 64, tables)
    _ask(svc, A, SpecSeq(1, 0, [1, 2, 3, 4], 0, "code"))
    _ask(svc, A, SpecSeq(1, 4, [5, 6], 0))
    _ask(svc, A, SpecSeq(2, 0, [1, 2, 3, 4], 0, "code"))  # the bound of one evicts seq 1
    _ask(svc, A, SpecSeq(2, 4, [5, 6], 0))  # the domain stays without being repeated
    svc.handle([A, ENC.encode(SpecEnd([1, 2]))])
    tables.flush()
    assert tables.learned == 1 and svc.stats.ends == 1
    tables.close()


# -- the process -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = log.read_text()
        if "ready at" in text:
            return text
        assert proc.poll() is None, f"spec exited: {text}"
        time.sleep(0.02)
    raise AssertionError(f"spec not ready in 15 s: {log.read_text()}")


def _start(endpoint: str, tmp_path: Path, n: int, metrics_port: int) -> tuple:
    cmd = [sys.executable, "-m", "services.spec", "--endpoint", endpoint, "--ngram-min", "2"]
    cmd += ["--ngram-max", "4", "--max-seqs", "8", "--metrics-port", str(metrics_port)]
    cmd += ["--table-dir", str(tmp_path / "tables")]
    log = tmp_path / f"spec-{n}.log"
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stderr=f), log


class _Worker:
    """A DEALER that sends one message and waits (bounded) for the reply."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.dec = decoder(SpecToWorker)

    def send(self, msg: SpecAsk | SpecEnd) -> None:
        self.sock.send(ENC.encode(msg))

    def ask(self, *seqs: SpecSeq) -> SpecDrafts:
        self.send(SpecAsk(list(seqs)))
        assert self.sock.poll(5000), f"no reply to {seqs!r}"
        return self.dec.decode(self.sock.recv())


def _wait_metric(port: int, name: str, value: float) -> None:
    deadline = time.monotonic() + 10
    while _metric(port, name) != value:
        assert time.monotonic() < deadline, f"{name} != {value}: {_metric(port, name)}"
        time.sleep(0.02)


def test_process_drafts_tables_metrics_and_a_restart(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []
    try:
        port = _free_port()
        proc, log = _start(endpoint, tmp_path, 0, port)
        procs.append(proc)
        line = _ready(proc, log)
        assert f"spec: ready at {endpoint}, prompt lookup over n-grams 2..4" in line
        assert f"domain tables at {tmp_path / 'tables'} (0 n-grams)" in line
        w = _Worker(ctx, endpoint)
        got = w.ask(SpecSeq(7, 0, [10, 11, 12, 13, 10, 11], 3))
        assert got == SpecDrafts([_draft(7, 6, [12, 13, 10])], [])
        got = w.ask(SpecSeq(7, 6, [12], 3), SpecSeq(8, 2, [1], 3))
        assert got == SpecDrafts([_draft(7, 7, [13, 10, 11])], [8])
        w.send(SpecEnd([7]))
        assert w.ask(SpecSeq(7, 7, [13], 3)) == SpecDrafts([], [7])  # forgotten
        for sid in (20, 21):  # the same output twice for the "code" table
            w.ask(SpecSeq(sid, 0, [900, 901], 0, "code"), SpecSeq(sid, 2, [40, 41, 42, 43], 0))
        w.send(SpecEnd([20, 21]))
        _wait_metric(port, "skiff_spec_table_learned_total", 2)  # counted on a thread
        table_draft = SpecDrafts([SpecDraft(22, 3, [42, 43], "table")], [])
        assert w.ask(SpecSeq(22, 0, [902, 40, 41], 2, "code")) == table_draft
        assert _metric(port, "skiff_spec_asks_total") == 6
        assert _metric(port, "skiff_spec_seqs_asked_total") == 9
        assert _metric(port, 'skiff_spec_drafts_total{source="prompt"}') == 2
        assert _metric(port, 'skiff_spec_draft_tokens_total{source="prompt"}') == 6
        assert _metric(port, 'skiff_spec_drafts_total{source="table"}') == 1
        assert _metric(port, "skiff_spec_unknown_total") == 2
        assert _metric(port, "skiff_spec_ends_total") == 3
        assert _metric(port, "skiff_spec_sequences") == 1
        ngrams = _metric(port, "skiff_spec_table_ngrams")
        assert ngrams > 0
        procs[-1].send_signal(signal.SIGTERM)
        assert procs[-1].wait(10) == 0

        proc, log = _start(endpoint, tmp_path, 1, _free_port())
        procs.append(proc)
        assert f"({int(ngrams)} n-grams)" in _ready(proc, log)  # the table outlived it
        assert w.ask(SpecSeq(22, 2, [41], 2, "code")) == SpecDrafts([], [22])  # a new service
        assert w.ask(SpecSeq(22, 0, [902, 40, 41], 2, "code")) == table_draft
        procs[-1].send_signal(signal.SIGINT)
        assert procs[-1].wait(10) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        ctx.destroy(0)


def test_bad_flags_exit_with_a_usage_error() -> None:
    cmd = [sys.executable, "-m", "services.spec", "--endpoint", "tcp://127.0.0.1:1"]
    cmd += ["--ngram-min", "5", "--ngram-max", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--ngram-min <= --ngram-max" in done.stderr

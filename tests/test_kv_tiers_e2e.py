"""The kvcache service's tiers with real processes: a gateway, a CPU worker serving SmolLM2 with
a deliberately small KV pool, and `python -m services.kvcache`. A long prompt, another that
displaces it from the pool, the first again: restored from the RAM tier, computing at most one
block of it, the same greedy text. The same after everything restarts (the disk tier); with a
byte of every stored value flipped (each dropped, the prompt computed, the same text); and with
the kvcache killed while requests run (none fails; the worker uses it again when it is back)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import Cluster, free_port, http_json, start_service

BLOCK = 16
# 30 blocks of 16 tokens: one ~360-token prompt and its answer fill most of the pool
WORKER_ARGS = ("--kv-blocks", "30", "--max-model-len", "480", "--max-batch-tokens", "512")


def _prompt(topic: str) -> str:
    words = (f"{topic} number {i} is listed here with its properties. " for i in range(30))
    return "".join(words) + f"Summarize the {topic} list in one sentence:"


class KVCache:
    def __init__(self, disk: Path, shm: Path) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.disk, self.shm = disk, shm
        self.proc: subprocess.Popen | None = None

    def start(self) -> KVCache:
        self.proc = start_service(
            "services.kvcache", "--endpoint", self.endpoint, "--ram-gb", "0.2",
            "--disk-dir", str(self.disk), "--disk-gb", "1", "--shm-dir", str(self.shm),
        )  # fmt: skip
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


def _complete(c: Cluster, prompt: str) -> tuple[str, int, int]:
    """(greedy text, prompt tokens, cached prompt tokens)."""
    name = c.model.name.removesuffix(".gguf")
    body = {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    status, out = http_json(f"{c.url}/v1/completions", body, timeout=120)
    assert status == 200, out
    usage = out["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return out["choices"][0]["text"], usage["prompt_tokens"], cached


def _cluster(model: Path, kv: KVCache) -> Cluster:
    return Cluster(model, 1, worker_args=(*WORKER_ARGS, "--kvcache", kv.endpoint)).start()


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "disk").mkdir()
    (tmp_path / "shm").mkdir()
    return tmp_path / "disk", tmp_path / "shm"


def test_restored_from_ram_then_from_disk_and_corrupt_values_recomputed(
    smollm2_path: Path, dirs: tuple[Path, Path]
) -> None:
    kv = KVCache(*dirs).start()
    c = _cluster(smollm2_path, kv)
    try:
        first, n, cached = _complete(c, _prompt("river"))
        assert n > 20 * BLOCK and cached == 0
        _complete(c, _prompt("mountain"))  # displaces most of the first from the pool
        again, n2, cached = _complete(c, _prompt("river"))
        assert n2 == n and again == first
        # every full block but the one holding the last prompt token came from a tier or the
        # pool; the pool kept at most its few leading blocks
        assert cached >= (n - 1) // BLOCK * BLOCK - BLOCK, (cached, n)
        # the worker's heartbeats carry its tier counts to the gateway's /metrics
        time.sleep(0.6)
        with urllib.request.urlopen(f"{c.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        restored = [
            line
            for line in text.splitlines()
            if line.startswith("skiff_kv_tier_events") and 'event="restored"' in line
        ]
        assert restored and float(restored[0].split()[-1]) >= cached // BLOCK - 8, restored
        # and its restores' times, a histogram per stage: the lookup's latency >= the copies'
        seconds = {
            (s.name, s.labels["stage"], s.labels.get("le")): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "skiff_kv_restore_seconds"
            for s in f.samples
        }
        for stage in ("latency", "copy"):
            count = seconds[("skiff_kv_restore_seconds_count", stage, None)]
            assert (
                count >= 1 and seconds[("skiff_kv_restore_seconds_bucket", stage, "+Inf")] == count
            )
        lat_sum = seconds[("skiff_kv_restore_seconds_sum", "latency", None)]
        assert 0 < seconds[("skiff_kv_restore_seconds_sum", "copy", None)] <= lat_sum < 5
    finally:
        c.stop()
        kv.stop()
    # everything restarts: the disk tier still holds the blocks
    kv = KVCache(*dirs).start()
    c = _cluster(smollm2_path, kv)
    try:
        again, _, cached = _complete(c, _prompt("river"))
        assert again == first
        assert cached >= (n - 1) // BLOCK * BLOCK - BLOCK, (cached, n)
    finally:
        c.stop()
        kv.stop()
    _flip_a_byte_of_every_value(dirs[0])
    kv = KVCache(*dirs).start()
    c = _cluster(smollm2_path, kv)
    try:
        again, _, cached = _complete(c, _prompt("river"))
        assert again == first and cached == 0  # each value checked, dropped, recomputed
        # the recomputed blocks were stored again: the next repeat restores them
        _complete(c, _prompt("mountain"))
        again, _, cached = _complete(c, _prompt("river"))
        assert again == first and cached >= (n - 1) // BLOCK * BLOCK - BLOCK
    finally:
        c.stop()
        kv.stop()


def _flip_a_byte_of_every_value(disk: Path) -> None:
    import lmdb

    paths = [p for p in disk.rglob("*") if p.name == "data.mdb"]
    assert paths, f"no LMDB environment under {disk}"
    env = lmdb.open(str(paths[0].parent), max_dbs=0, map_size=1 << 31)
    with env.begin(write=True) as txn:
        entries = list(txn.cursor())
        assert entries
        for key, value in entries:
            flipped = bytearray(value)
            flipped[-1] ^= 0xFF  # the last byte of the KV payload
            txn.put(key, bytes(flipped))
    env.close()


def test_kvcache_killed_while_requests_run(smollm2_path: Path, dirs: tuple[Path, Path]) -> None:
    kv = KVCache(*dirs).start()
    c = _cluster(smollm2_path, kv)
    try:
        results: list[tuple[str, int, int] | Exception] = []

        def ask(topic: str) -> None:
            try:
                results.append(_complete(c, _prompt(topic)))
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                results.append(exc)

        threads = [threading.Thread(target=ask, args=(t,)) for t in ("lake", "hill", "cave")]
        for t in threads:
            t.start()
        time.sleep(0.3)
        kv.stop(signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
        assert len(results) == 3 and not [r for r in results if isinstance(r, Exception)]
        # with the kvcache gone the worker serves from its pool alone
        first, n, _ = _complete(c, _prompt("forest"))
        kv.start()  # back on its endpoint: the worker attaches to the new process
        time.sleep(3)
        _complete(c, _prompt("forest"))
        _complete(c, _prompt("desert"))  # displaces it
        again, _, cached = _complete(c, _prompt("forest"))
        assert again == first and cached >= (n - 1) // BLOCK * BLOCK - BLOCK, cached
    finally:
        c.stop()
        kv.stop()

"""KVCacheConfig: the kvcache process's one typed config, built once from its flags."""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30
RAM_SHARE = 0.10  # of MemAvailable, by default (the segment is reserved at start)
RAM_CAP_GB = 8.0  # llama-server's --cache-ram default


@dataclass(frozen=True)
class KVCacheConfig:
    endpoint: str
    ram_bytes: int  # 0: the RAM tier is off (every grant and lookup is empty)
    disk_dir: str
    disk_bytes: int  # 0: the disk tier is off
    shm_dir: str
    metrics_port: int = 0  # 0: no Prometheus endpoint
    summary_interval_s: float = 30.0
    worker_timeout_s: float = 30.0  # a worker silent this long is gone: its slots are freed


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 * GiB  # no /proc (not Linux): a modest guess


def default_ram_gb() -> float:
    return min(RAM_CAP_GB, mem_available_bytes() * RAM_SHARE / GiB)


def default_disk_dir() -> str:
    root = os.environ.get("SKIFF_CACHE_DIR") or str(Path.home() / ".cache" / "skiff")
    return os.path.join(root, "kv")


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def parse_kvcache_args(argv: list[str] | None, description: str | None = None) -> KVCacheConfig:
    p = argparse.ArgumentParser(prog="python -m services.kvcache", description=description)
    p.add_argument("--endpoint", required=True, help="ROUTER address, e.g. tcp://127.0.0.1:5599")
    p.add_argument(
        "--ram-gb",
        type=float,
        default=None,
        help=f"shared-memory RAM tier size (default: {RAM_SHARE * 100:.0f}%% of MemAvailable, "
        f"at most {RAM_CAP_GB:g}); 0 turns it off",
    )
    p.add_argument("--disk-dir", default=None, help="disk tier dir (default $SKIFF_CACHE_DIR/kv)")
    p.add_argument("--disk-gb", type=float, default=8.0, help="disk tier cap; 0 turns it off")
    p.add_argument("--shm-dir", default=None, help="where the RAM segments live (/dev/shm)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port on 127.0.0.1")
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=30.0,
        help="seconds of silence after which a worker is gone and its granted and pinned "
        "slots are freed (attached workers send something every 2 s)",
    )
    a = p.parse_args(argv)
    ram_gb = default_ram_gb() if a.ram_gb is None else a.ram_gb
    if ram_gb < 0 or a.disk_gb < 0:
        p.error("--ram-gb and --disk-gb must be >= 0")
    return KVCacheConfig(
        endpoint=a.endpoint,
        ram_bytes=int(ram_gb * GiB),
        disk_dir=os.path.expanduser(a.disk_dir or default_disk_dir()),
        disk_bytes=int(a.disk_gb * GiB),
        shm_dir=a.shm_dir or default_shm_dir(),
        metrics_port=a.metrics_port,
        worker_timeout_s=a.worker_timeout,
    )

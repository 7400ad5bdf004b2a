"""What `skiff serve` starts: its config, the devices that get a worker, the ports that join the
processes and each process's command line."""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shared.launch.devices import cpu_count, resolve_devices
from shared.launch.spec_flag import HELP as SPEC_HELP
from shared.launch.spec_flag import parse_spec, spec_service_argv
from shared.launch.spec_flag import worker_args as spec_worker_args

DTYPES = ("float32", "float16", "bfloat16")
# The checkout this module runs from; children get it on PYTHONPATH so that they run the same code
# as the launcher even when it was started from another directory.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class ServeConfig:
    """Everything `skiff serve` was asked for, built once from its flags."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 8000
    devices: str = "auto"  # auto | cpu | cuda | comma-separated cpu / cuda:N
    # prefill and decode as separate workers: both lists given (a device may be in both)
    prefill_devices: str = ""
    decode_devices: str = ""
    # one worker whose model is split over every device of --devices as pipeline stages
    pipeline: bool = False
    layer_split: str = ""  # the stages' layers, e.g. "20,12" ("": planned by the worker)
    memory_gib: str = ""  # the stages' memory caps, e.g. "20,12" ("": each device's free memory)
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    dtype: str | None = None  # None: each worker's default
    kv_dtype: str | None = None  # None: the workers' default (the activation dtype)
    kv_scales: str | None = None  # None: the workers' default (token)
    max_model_len: int | None = None
    kv_blocks: int | None = None
    max_batch_tokens: int | None = None
    overlap: bool = True  # workers prepare step N+1 while the device runs step N
    step_target_ms: float | None = None  # workers cap prompt chunks beside decodes
    dense_copies: str | None = None  # None: the workers' default (auto)
    cuda_graphs: str | None = None  # None: the workers' default (all)
    cpu_weights: str | None = None  # None: the workers' default (native)
    threads: int | None = None  # None: the workers' default (the cores they may run on)
    # the kvcache service's tiers (None: its defaults; 0 turns a tier off; both 0: no service)
    kv_ram_gb: float | None = None
    kv_disk_gb: float | None = None
    kv_disk_dir: str | None = None
    spec: str = "ngram"  # the spec service's proposers (ngram, draft:PATH), or "off"
    spec_max_tokens: int | None = None  # None: the workers' default
    stop_timeout_s: float = 10.0  # SIGTERM to SIGKILL

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name.removesuffix(".gguf")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        return cls(
            model=Path(args.model).expanduser().resolve(),
            host=args.host,
            port=args.port,
            devices=args.devices,
            prefill_devices=args.prefill_devices or "",
            decode_devices=args.decode_devices or "",
            pipeline=args.pipeline or bool(args.layer_split),
            layer_split=args.layer_split or "",
            memory_gib=args.memory_gib or "",
            api_keys=tuple(args.api_key or ()),
            served_model_name=args.served_model_name,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            kv_scales=args.kv_scales,
            max_model_len=args.max_model_len,
            kv_blocks=args.kv_blocks,
            max_batch_tokens=args.max_batch_tokens,
            overlap=args.overlap,
            step_target_ms=args.step_target_ms,
            dense_copies=args.dense_copies,
            cuda_graphs=args.cuda_graphs,
            cpu_weights=args.cpu_weights,
            threads=args.threads,
            kv_ram_gb=args.kv_ram_gb,
            kv_disk_gb=args.kv_disk_gb,
            kv_disk_dir=args.kv_disk_dir,
            spec=args.spec,
            spec_max_tokens=args.spec_max_tokens,
            stop_timeout_s=args.stop_timeout,
        )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--devices",
        default="auto",
        help="auto (every CUDA device, else the CPU), cpu, cuda, or a list such as cuda:0,cuda:1",
    )
    p.add_argument(
        "--prefill-devices",
        default=None,
        help="prefill workers' devices (e.g. cuda:0 or cpu): they compute prompts and hand "
        "them on, through the kvcache, to the decode workers; with --decode-devices, instead "
        "of --devices",
    )
    p.add_argument(
        "--decode-devices",
        default=None,
        help="decode workers' devices (e.g. cuda:1,cuda:2); a device may also be a prefill one",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="one worker whose model is split by layers over the --devices (in that order) as "
        "pipeline stages, e.g. --devices cuda:0,cpu: the split is planned from each device's "
        "free memory and measured bandwidth",
    )
    p.add_argument(
        "--layer-split",
        default=None,
        help="with --pipeline (implied): the layers of each stage, e.g. 20,12",
    )
    p.add_argument(
        "--memory-gib",
        default=None,
        help="with --pipeline: the memory each stage may use, GiB, e.g. 20,12 (one GPU can "
        "stand in for a smaller pair)",
    )
    p.add_argument("--api-key", action="append", help="accepted bearer token; repeat for several")
    p.add_argument("--served-model-name", default=None, help="model name of the API")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="activation dtype of workers")
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=[*DTYPES, "fp8"],
        help="KV cache dtype of workers (default: the activation dtype; fp8: e4m3 with "
        "per-token scales, on sm_89+ GPUs)",
    )
    p.add_argument(
        "--kv-scales",
        default=None,
        choices=["token", "head"],
        help="an fp8 KV cache's scales: token (default; one per token and KV head) or head (one "
        "per layer and KV head, calibrated when a worker starts: half of fp16's bytes exactly)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context limit per request")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="token budget per step")
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers schedule and launch step N+1 before step N's tokens reach the host "
        "(default on; --no-overlap: one step at a time)",
    )
    p.add_argument(
        "--step-target-ms",
        type=float,
        default=None,
        help="workers keep steps that carry decodes within twice the decodes' own time and at "
        "least this many ms (default 20; -1: prompt chunks up to --max-batch-tokens)",
    )
    p.add_argument(
        "--dense-copies",
        default=None,
        choices=["auto", "on", "off"],
        help="dense copies of quantized weights for batches of more than 16 rows (default auto: "
        "where the GPU has four times their size free)",
    )
    p.add_argument(
        "--cpu-weights",
        default=None,
        choices=["native", "int4", "float"],
        help="a CPU worker's quantized weights: native (default: GGUF blocks, a C library), "
        "int4 (torch's int4 GEMM) or float (float32 copies)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="a CPU worker's threads (default: the cores it may run on)",
    )
    p.add_argument(
        "--cuda-graphs",
        default=None,
        choices=["all", "decode", "off"],
        help="steps workers replay from CUDA graphs: all (default: decode and mixed steps), "
        "decode, or off",
    )
    p.add_argument(
        "--kv-ram-gb",
        type=float,
        default=None,
        help="the kvcache service's RAM tier of KV blocks, reserved at start (default: a tenth "
        "of the free RAM, at most 8; 0: off)",
    )
    p.add_argument(
        "--kv-disk-gb",
        type=float,
        default=None,
        help="its disk tier, LMDB under --kv-disk-dir (default 8; 0: off; both tiers 0: no "
        "kvcache service)",
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        help="the disk tier's directory (default: the cache directory's kv/; it outlives restarts)",
    )
    p.add_argument("--spec", default="ngram", type=parse_spec, help=SPEC_HELP)
    p.add_argument(
        "--spec-max-tokens",
        type=int,
        default=None,
        help="the longest draft a step verifies (default 8; each sequence's follows its "
        "acceptance)",
    )
    p.add_argument(
        "--stop-timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL"
    )


# -- devices --------------------------------------------------------------------------------------


def resolve_split(config: ServeConfig) -> tuple[list[str], list[str]] | None:
    """(prefill devices, decode devices) when both are given, None when neither is."""
    prefill, decode = config.prefill_devices.strip(), config.decode_devices.strip()
    if not prefill and not decode:
        return None
    if not prefill or not decode:
        raise ValueError("--prefill-devices and --decode-devices go together")
    for spec in (prefill, decode):
        if spec.lower() in ("auto", "cuda"):
            raise ValueError(f"name the devices of each role (cpu, cuda:N), not {spec!r}")
    return resolve_devices(prefill), resolve_devices(decode)


# -- processes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    """The gateway's two ZMQ sockets, which it binds and every worker connects to."""

    worker: str  # ROUTER: requests down, ready/heartbeats up
    tokens: str  # PULL: token batches up
    kvcache: str = ""  # the kvcache service's ROUTER, which it binds and workers connect to
    spec: str = ""  # the spec service's ROUTER, likewise


def local_endpoints(host: str = "127.0.0.1") -> Endpoints:
    # Both sockets are held open together so that the OS cannot hand out one port twice.
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(4)]
    try:
        for s in socks:
            s.bind((host, 0))
        a, b, c, d = (s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()
    return Endpoints(*(f"tcp://{host}:{p}" for p in (a, b, c, d)))


@dataclass(frozen=True)
class Plan:
    """The processes to start: argv of the gateway, of the services beside it (the kvcache;
    restarted when they exit) and of each named worker."""

    gateway: list[str]
    workers: dict[str, list[str]]
    health_url: str
    api_url: str
    model_name: str
    services: dict[str, list[str]] = field(default_factory=dict)


def _url_host(host: str) -> str:
    # A wildcard address is where the server listens, not where a client can reach it.
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def plan_processes(
    config: ServeConfig,
    devices: list[str],
    endpoints: Endpoints,
    python: str = sys.executable,
    prefill: list[str] | None = None,
) -> Plan:
    """With `prefill` devices, `devices` are the decode workers' and the prompts are computed
    by prefill workers, which hand them on through the kvcache (on for every worker then)."""
    model = str(config.model)
    gateway = [
        python, "-m", "services.gateway",
        "--model", model,
        "--host", config.host,
        "--port", str(config.port),
        "--worker-bind", endpoints.worker,
        "--tokens-bind", endpoints.tokens,
        # Always named, so that the name printed with the URL is the name the API accepts.
        "--served-model-name", config.model_name,
    ]  # fmt: skip
    for key in config.api_keys:
        gateway += ["--api-key", key]
    optional = {
        "--dtype": config.dtype,
        "--kv-dtype": config.kv_dtype,
        "--kv-scales": config.kv_scales,
        "--max-model-len": config.max_model_len,
        "--kv-blocks": config.kv_blocks,
        "--max-batch-tokens": config.max_batch_tokens,
        "--step-target-ms": config.step_target_ms,
        "--dense-copies": config.dense_copies,
        "--cuda-graphs": config.cuda_graphs,
        "--cpu-weights": config.cpu_weights,
        "--threads": config.threads,
    }
    extra = [s for flag, v in optional.items() if v is not None for s in (flag, str(v))]
    extra.append("--overlap" if config.overlap else "--no-overlap")
    services = {}
    # The tiers for CPU workers only, until the GPU path (a block's copies queued layer by
    # layer beside the steps) is measured not to slow W2/W3; by hand, `--kvcache` works there
    kv_devices = [d for d in devices if d == "cpu" and not config.pipeline]  # not yet there
    if prefill:  # the prompts' blocks move through the RAM tier
        kv_devices = sorted({*devices, *prefill})
    tiers_on = config.kv_ram_gb != 0 or config.kv_disk_gb != 0
    if prefill and not tiers_on:
        tiers_on = True  # the RAM tier carries the hand-offs even when asked off
    if endpoints.kvcache and tiers_on and kv_devices:
        kvcache = [python, "-m", "services.kvcache", "--endpoint", endpoints.kvcache]
        tiers = {"--ram-gb": config.kv_ram_gb, "--disk-gb": config.kv_disk_gb,
                 "--disk-dir": config.kv_disk_dir}  # fmt: skip
        kvcache += [s for flag, v in tiers.items() if v is not None for s in (flag, str(v))]
        services["kvcache"] = kvcache
    # Speculation for CPU workers only, until the GPU verification steps are measured on the
    # device (W5); by hand, a GPU worker's `--spec` works
    spec_devices = [d for d in devices if d == "cpu"]
    if endpoints.spec and config.spec != "off" and spec_devices:
        services["spec"] = spec_service_argv(python, endpoints.spec, config.spec, model)
    spec_extra = spec_worker_args(config.spec) + (
        ["--spec-max-tokens", str(config.spec_max_tokens)] if config.spec_max_tokens else []
    )
    roles = [("worker", "services.decode", d) for d in devices]
    stages = []
    if config.pipeline:  # stage 0 is the worker; it starts the stage processes itself
        roles = [("pipeline", "services.decode", devices[0])]
        stages = ["--stages", ",".join(devices[1:])] if len(devices) > 1 else []
        stages += ["--layer-split", config.layer_split] if config.layer_split else []
        stages += ["--memory-gib", config.memory_gib] if config.memory_gib else []
    if prefill:
        roles = [("prefill", "services.prefill", d) for d in prefill] + [
            ("decode", "services.decode", d) for d in devices
        ]
    threads = []
    n_cpu = sum(d == "cpu" for _, _, d in roles)
    if config.threads is None and n_cpu > 1:  # CPU workers share the cores
        threads = ["--threads", str(max(1, cpu_count() // n_cpu))]
    workers = {
        f"{role} {'+'.join(devices) if role == 'pipeline' else d}": [
            python,
            "-m",
            module,
            "--model",
            model,
            "--device",
            d,
            "--gateway",
            endpoints.worker,
            "--gateway-tokens",
            endpoints.tokens,
            *extra,
            *stages,
            *(threads if d == "cpu" else []),
            *(
                ["--kvcache", endpoints.kvcache]
                if "kvcache" in services and d in kv_devices
                else []
            ),
            *(
                ["--spec", endpoints.spec, *spec_extra]
                if "spec" in services and d in spec_devices and role != "prefill"
                else []
            ),
        ]  # fmt: skip
        for role, module, d in roles
    }
    base = f"http://{_url_host(config.host)}:{config.port}"
    return Plan(gateway, workers, f"{base}/health", f"{base}/v1", config.model_name, services)

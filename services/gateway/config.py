"""The gateway's one configuration object, built once from command-line flags and environment.

Every flag has an environment variable (SKIFF_*) so that containers can be configured without a
command line; a flag given on the command line wins over its variable.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.protocol import DOMAIN_PATTERN, HEARTBEAT_TIMEOUT_S

DEFAULT_WORKER_BIND = "tcp://127.0.0.1:5555"
DEFAULT_TOKENS_BIND = "tcp://127.0.0.1:5556"


@dataclass(frozen=True)
class GatewayConfig:
    model: Path  # the GGUF file: the gateway reads its header only (tokenizer, template)
    served_model_name: str  # the `model` name clients send and /v1/models lists
    host: str = "127.0.0.1"
    port: int = 8000
    worker_bind: str = DEFAULT_WORKER_BIND  # ROUTER: requests down, ready/heartbeats up
    tokens_bind: str = DEFAULT_TOKENS_BIND  # PULL: one StepTokens per worker step
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # an API key's domain n-gram table, for its requests that name none
    key_domains: dict[str, str] = field(default_factory=dict)
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        env = os.environ if env is None else env
        args = build_parser(env).parse_args(argv)
        if args.model is None:
            raise SystemExit("error: --model (or SKIFF_MODEL) is required")
        keys = list(args.api_key or [])
        keys += [k.strip() for k in env.get("SKIFF_API_KEYS", "").split(",") if k.strip()]
        model = Path(args.model)
        return cls(
            model=model,
            served_model_name=args.served_model_name or model.stem,
            host=args.host,
            port=args.port,
            worker_bind=args.worker_bind,
            tokens_bind=args.tokens_bind,
            api_keys=tuple(dict.fromkeys(keys)),
            key_domains=_key_domains(args.key_domain or []),
            heartbeat_timeout_s=args.heartbeat_timeout,
        )


def _key_domains(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, _, domain = pair.partition("=")
        if not key or not re.fullmatch(DOMAIN_PATTERN, domain):
            raise SystemExit(f"error: --key-domain wants KEY=DOMAIN (a table's name), got {pair!r}")
        out[key] = domain
    return out


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="Skiff gateway: the OpenAI-compatible HTTP API in front of the workers.",
    )
    p.add_argument(
        "--model",
        default=env.get("SKIFF_MODEL"),
        help="GGUF model file; only its header is read [env SKIFF_MODEL]",
    )
    p.add_argument(
        "--served-model-name",
        default=env.get("SKIFF_SERVED_MODEL_NAME"),
        help="model name of the API (default: the file name without .gguf) "
        "[env SKIFF_SERVED_MODEL_NAME]",
    )
    p.add_argument(
        "--host",
        default=env.get("SKIFF_HOST", "127.0.0.1"),
        help="HTTP listen address (default 127.0.0.1) [env SKIFF_HOST]",
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env.get("SKIFF_PORT", "8000")),
        help="HTTP port (default 8000) [env SKIFF_PORT]",
    )
    p.add_argument(
        "--worker-bind",
        default=env.get("SKIFF_WORKER_BIND", DEFAULT_WORKER_BIND),
        help=f"ZMQ ROUTER address workers connect to (default {DEFAULT_WORKER_BIND}) "
        "[env SKIFF_WORKER_BIND]",
    )
    p.add_argument(
        "--tokens-bind",
        default=env.get("SKIFF_TOKENS_BIND", DEFAULT_TOKENS_BIND),
        help=f"ZMQ PULL address workers push tokens to (default {DEFAULT_TOKENS_BIND}) "
        "[env SKIFF_TOKENS_BIND]",
    )
    p.add_argument(
        "--api-key",
        action="append",
        help="accepted bearer token; repeat for several (added to the comma-separated "
        "env SKIFF_API_KEYS); none: no authentication",
    )
    p.add_argument(
        "--key-domain",
        action="append",
        metavar="KEY=DOMAIN",
        help="the domain n-gram table (speculation) of an API key's requests that name none in "
        "their 'domain' field; repeat for several",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=float(env.get("SKIFF_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S)),
        help=f"seconds of silence after which a worker is dead (default {HEARTBEAT_TIMEOUT_S}) "
        "[env SKIFF_HEARTBEAT_TIMEOUT]",
    )
    return p

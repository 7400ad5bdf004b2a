"""The flags of `skiff bench` and the one typed config built from them."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    url: str  # the server's base, without a trailing /v1
    model: str | None  # None: the first of GET /v1/models
    endpoint: str  # "completions" or "chat"
    num_prompts: int
    concurrency: int | None  # None: no cap on requests in flight
    request_rate: float  # requests per second, Poisson arrivals; inf: all at once
    input_len: int
    output_len: int
    dataset: str | None
    ignore_eos: bool
    api_key: str | None
    seed: int
    json_path: str | None
    progress: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        url = args.url.rstrip("/")
        url = url.removesuffix("/v1")  # both http://host:8000 and http://host:8000/v1 work
        if args.num_prompts < 1:
            raise SystemExit("skiff bench: --num-prompts must be at least 1")
        if args.concurrency is not None and args.concurrency < 1:
            raise SystemExit("skiff bench: --concurrency must be at least 1")
        if not args.request_rate > 0:
            raise SystemExit("skiff bench: --request-rate must be above 0 (inf: all at once)")
        if args.input_len < 1 or args.output_len < 1:
            raise SystemExit("skiff bench: --input-len and --output-len must be at least 1")
        return cls(
            url=url,
            model=args.model,
            endpoint=args.endpoint,
            num_prompts=args.num_prompts,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            input_len=args.input_len,
            output_len=args.output_len,
            dataset=args.dataset,
            ignore_eos=args.ignore_eos,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
            seed=args.seed,
            json_path=args.json,
            progress=not args.no_progress,
        )

    def as_dict(self) -> dict:
        """The run's settings for the JSON file (the key left out)."""
        out = {k: v for k, v in vars(self).items() if k not in ("api_key", "progress")}
        out["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        out["max_concurrency"] = out.pop("concurrency")  # vLLM's name
        return out


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (100)")
    p.add_argument(
        "--concurrency", type=int, default=None, help="most requests in flight (default: no cap)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument(
        "--input-len", type=int, default=512, help="random prompts' words, ~tokens (512)"
    )
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of each request (256)")
    p.add_argument(
        "--dataset",
        default=None,
        help="prompts from a file: JSONL with a 'prompt' field, a JSON list of strings, or "
        "ShareGPT conversations (the first human turn); cycled if shorter than --num-prompts",
    )
    p.add_argument("--ignore-eos", action="store_true", help="ask for all --output-len tokens")
    p.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and arrivals (0)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write every number here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

"""The `skiff` command line (also `python -m shared.cli`).

- `skiff serve MODEL.gguf`: the gateway and one worker per device as processes on this machine
  (shared.launch), until Ctrl-C.
- `skiff generate MODEL.gguf "prompt"`: runs the engine in this process and prints the
  continuation as it streams, then the prompt size and the decode speed.
- `skiff spec learn PATH... --domain NAME --model MODEL.gguf`: counts the text files under the
  paths into the spec service's domain n-gram table before serving (services/spec/learn.py).
- `skiff bench URL`: a serving benchmark against any OpenAI-compatible server (shared/bench/).
"""

from __future__ import annotations

import argparse
import sys
import time

from shared import launch
from shared.launch.spec_flag import check_draft


def _generate(args: argparse.Namespace) -> int:
    # Imported here: `skiff serve` and `--help` should not pay for importing torch.
    from shared.engine import Sequence
    from shared.engine.factory import EngineConfig, build_engine
    from shared.sampling import SamplingParams, make_generator
    from shared.tokenizer import ChatTemplate, IncrementalDetokenizer

    t0 = time.perf_counter()
    loaded = build_engine(
        EngineConfig(
            model_path=args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
        )
    )
    tok, engine = loaded.tokenizer, loaded.engine
    load_s = time.perf_counter() - t0
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        text = ChatTemplate.from_metadata(loaded.gguf.metadata).render(messages)
        ids = tok.encode(text, add_special=False, special=True)
    else:
        ids = tok.encode(args.prompt, add_special=True, special=False)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    ).validate()
    seq = Sequence(
        0,
        ids,
        params,
        args.max_tokens,
        frozenset(tok.stop_ids),
        make_generator(args.seed, args.device),
    )
    engine.add(seq)
    detok = IncrementalDetokenizer(tok)
    t_start = time.perf_counter()
    t_first = None
    n_out = 0
    while engine.has_work():
        for ev in engine.step():
            if t_first is None:
                t_first = time.perf_counter()
            n_out += 1
            if ev.finish_reason == "stop":
                continue
            sys.stdout.write(detok.push(ev.token_id))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    t_end = time.perf_counter()
    decode_s = t_end - (t_first or t_end)
    rate = (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0
    print(
        f"[load {load_s:.1f} s | prompt {len(ids)} tokens in {(t_first or t_end) - t_start:.2f} s"
        f" | {n_out} tokens generated, {rate:.1f} tok/s | finish: {seq.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skiff", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over the OpenAI API on this machine")
    launch.add_serve_arguments(s)
    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    g.add_argument("model", help="path to a GGUF file")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    from services.spec.learn import add_learn_arguments  # stdlib and lmdb: no torch, no model

    sp = sub.add_parser("spec", help="speculative decoding's domain tables")
    spec_sub = sp.add_subparsers(dest="spec_command", required=True)
    learn = spec_sub.add_parser("learn", help="count files into a domain's n-gram table")
    add_learn_arguments(learn)
    from shared.bench.options import add_bench_arguments  # argparse only: no aiohttp, no torch

    add_bench_arguments(sub.add_parser("bench", help="benchmark an OpenAI-compatible server"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        config = launch.ServeConfig.from_args(args)
        if why := check_draft(config.spec, str(config.model)):
            print(f"skiff serve: {why}", file=sys.stderr)
            return 2
        return launch.serve(config)
    if args.command == "generate":
        return _generate(args)
    if args.command == "spec":
        from services.spec.learn import run_learn

        return run_learn(args)
    if args.command == "bench":
        from shared.bench.options import BenchConfig
        from shared.bench.run import run_bench

        return run_bench(BenchConfig.from_args(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())

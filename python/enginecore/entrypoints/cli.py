"""The ``enginecore`` command: ``generate`` (the default model) and ``synthetic``
(an engine run on the synthetic executor, to see the engine work on its own)."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _synthetic(args: argparse.Namespace) -> int:
    from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
    from enginecore.executor import SyntheticExecutor

    config = EngineArgs(
        model="synthetic", max_num_seqs=args.num_requests, use_native=args.native,
        synthetic_step_latency_s=args.latency_ms / 1e3,
    ).create_engine_config()
    engine = EngineCore(config, SyntheticExecutor, log_stats=True)
    for i in range(args.num_requests):
        prompt = [(i * 7919 + j) % 32000 for j in range(args.prompt_len)]
        engine.add_request(EngineCoreRequest(
            f"req-{i}", prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)))
    t0 = time.perf_counter()
    steps = tokens = finished = 0
    while engine.scheduler.has_requests():
        outputs, _ = engine.step()
        steps += 1
        for outs in outputs.values():
            for o in outs.outputs:
                tokens += len(o.new_token_ids)
                finished += o.finished
    elapsed = time.perf_counter() - t0
    print(
        f"synthetic engine run: {args.num_requests} requests x {args.max_tokens} tokens "
        f"(prompt {args.prompt_len}) -> {finished} finished, {tokens} tokens in {steps} steps, "
        f"{elapsed:.3f} s ({tokens / elapsed:,.0f} tokens/s, {1e3 * elapsed / steps:.3f} ms/step), "
        f"native={engine.config.use_native if engine.config.use_native is not None else 'env'}"
    )
    engine.shutdown()
    return 0


def _generate(args: argparse.Namespace) -> int:
    from enginecore.entrypoints.generate import run_generate

    return run_generate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="enginecore", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a model (default: SmolLM2-135M)")
    gen.add_argument("prompt", help="the prompt (a chat message with --chat)")
    gen.add_argument("--model", default=None, help="HF directory or .gguf file; default model")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="apply the model's chat template (default on)")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.set_defaults(func=_generate)

    syn = sub.add_parser("synthetic", help="run the engine on the synthetic executor")
    syn.add_argument("--num-requests", type=int, default=256)
    syn.add_argument("--prompt-len", type=int, default=64)
    syn.add_argument("--max-tokens", type=int, default=128)
    syn.add_argument("--latency-ms", type=float, default=0.0)
    syn.add_argument("--native", action=argparse.BooleanOptionalAction, default=None)
    syn.set_defaults(func=_synthetic)

    from enginecore.entrypoints.headless import add_parser

    add_parser(sub)
    _add_serve_and_chat(sub)
    return parser


def _add_serve_and_chat(sub: argparse._SubParsersAction) -> None:
    from enginecore.entrypoints import chat
    from enginecore.entrypoints.openai.cli_args import add_serve_args

    def serve(args: argparse.Namespace) -> int:
        from enginecore.entrypoints.openai.launcher import run_serve

        return run_serve(args)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server (default model if none)")
    add_serve_args(srv).set_defaults(func=serve)
    chat.add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

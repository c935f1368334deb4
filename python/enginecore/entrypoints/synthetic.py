"""``enginecore synthetic``: the engine on the synthetic executor (no model), to
see the scheduler, KV cache and output path work on their own and time them."""

from __future__ import annotations

import argparse
import time

from enginecore.entrypoints.cli_common import add_subcommand, user_errors


def add_parser(sub: argparse._SubParsersAction) -> None:
    from enginecore.config import EngineArgs

    syn = add_subcommand(
        sub, "synthetic", "run the engine on the synthetic executor (no model)",
        "Run requests through the engine on the synthetic executor, a measuring instrument "
        "that stands in for the model, and print the throughput. Every engine flag applies.")
    run = syn.add_argument_group("The run")
    run.add_argument("--num-requests", type=int, default=256, metavar="N",
                     help="requests, all added at the start")
    run.add_argument("--prompt-len", type=int, default=64, metavar="N",
                     help="prompt tokens per request")
    run.add_argument("--max-tokens", type=int, default=128, metavar="N",
                     help="tokens each request generates (EOS ignored)")
    run.add_argument("--latency-ms", type=float, default=None, metavar="MS",
                     help="milliseconds per step (--synthetic-step-latency-s in ms)")
    run.add_argument("--native", action=argparse.BooleanOptionalAction, dest="use_native",
                     default=None, help="same as --use-native / --no-use-native")
    EngineArgs.add_cli_args(syn)
    syn.set_defaults(func=run_synthetic, model="synthetic", max_num_seqs=None)


def run_synthetic(args: argparse.Namespace) -> int:
    from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
    from enginecore.executor import SyntheticExecutor

    if args.max_num_seqs is None:  # by default all requests run at once
        args.max_num_seqs = args.num_requests
    if args.latency_ms is not None:
        args.synthetic_step_latency_s = args.latency_ms / 1e3
    with user_errors():
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        if args.num_requests < 1 or args.prompt_len < 1:
            raise ValueError("--num-requests and --prompt-len must be >= 1")
        config = EngineArgs.from_cli_args(args).create_engine_config()
        engine = EngineCore(config, SyntheticExecutor)
    try:
        vocab = config.model_config.vocab_size
        for i in range(args.num_requests):
            prompt = [(i * 7919 + j) % vocab for j in range(args.prompt_len)]
            engine.add_request(EngineCoreRequest(f"req-{i}", prompt, params))
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
    finally:
        engine.shutdown()
    native = config.use_native if config.use_native is not None else "env"
    print(
        f"synthetic engine run: {args.num_requests} requests x {args.max_tokens} tokens "
        f"(prompt {args.prompt_len}) -> {finished} finished, {tokens} tokens in {steps} steps, "
        f"{elapsed:.3f} s ({tokens / elapsed:,.0f} tokens/s, {1e3 * elapsed / steps:.3f} ms/step), "
        f"native={native}"
    )
    return 0

"""``enginecore generate``: stream one answer from a model to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from enginecore.entrypoints.cli_common import UserError, add_subcommand, user_errors


def add_parser(sub: argparse._SubParsersAction) -> None:
    from enginecore.config import EngineArgs

    gen = add_subcommand(
        sub, "generate", "generate an answer to one prompt and stream it",
        "Generate an answer to one prompt and stream it to stdout (timings on stderr). "
        "The engine runs in this process; every engine flag below applies.")
    gen.add_argument("prompt", help="the prompt (the user message with --chat)")
    sampling = gen.add_argument_group("Sampling (checked before the model loads)")
    sampling.add_argument("--max-tokens", type=int, default=128, metavar="N",
                          help="most tokens to generate")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="0: greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="nucleus sampling: keep the most likely tokens up to this mass")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K",
                          help="keep the K most likely tokens (0: all)")
    sampling.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                          help="apply the model's chat template to the prompt")
    EngineArgs.add_cli_args(gen)
    # One prompt: one sequence and a small KV cache (--kv-cache-memory-bytes changes it),
    # big enough for the default model's whole context in float32 (the dtype a CPU
    # without AVX-512 runs), so the first command a user runs warns of no cap.
    gen.set_defaults(func=run_generate, max_num_seqs=1, kv_cache_memory_bytes=512 << 20)


def run_generate(args: argparse.Namespace) -> int:
    from enginecore.config import EngineArgs
    from enginecore.protocol import EngineCoreRequest
    from enginecore.sampling_params import SamplingParams

    t0 = time.perf_counter()
    with user_errors():
        # Sampling values first: a bad one fails before any model is fetched or loaded.
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        config = EngineArgs.from_cli_args(args).create_engine_config()
    mc = config.model_config
    if mc.is_synthetic:
        raise UserError("generate needs a real model (the synthetic model has no tokenizer); "
                        "`enginecore synthetic` runs the engine on it")
    if mc.task != "generate":
        raise UserError(f"{mc.model} is a {mc.task} model; generate needs a decoder")
    from enginecore.core.engine_core import EngineCore
    from enginecore.frontend.detokenizer import DetokenizerFactory
    from enginecore.model.tokenizer import Tokenizer

    with user_errors():
        tokenizer = Tokenizer.from_dir(mc.model_path)
        if args.chat and tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(args.prompt)
        engine = EngineCore(config)
    try:
        with user_errors():
            engine.add_request(EngineCoreRequest("cli", ids, params))
        return _stream(engine, DetokenizerFactory(tokenizer).new(True, ids), mc.model, t0)
    finally:
        engine.shutdown()


def _stream(engine, decoder, model: str, t0: float) -> int:
    t_first = None
    n = 0
    reason = None
    try:
        while engine.scheduler.has_requests():
            outputs, executed = engine.step()
            engine.post_step(executed)
            for outs in outputs.values():
                for o in outs.outputs:
                    if o.new_token_ids and t_first is None:
                        t_first = time.perf_counter()
                    n += len(o.new_token_ids)
                    new = o.new_token_ids
                    if o.finish_reason is not None and str(o.finish_reason) == "stop" and new:
                        new = new[:-1]  # EOS / stop token: not part of the answer
                    sys.stdout.write(decoder.decode(new))
                    if o.finish_reason is not None:
                        sys.stdout.write(decoder.flush())
                        reason = o.finish_reason
                    sys.stdout.flush()
    finally:
        sys.stdout.write("\n")  # also after a Ctrl-C: the shell prompt starts on its own line
        sys.stdout.flush()
    t_end = time.perf_counter()
    decode_s = t_end - (t_first or t_end)
    print(f"[{model}: {n} tokens, finish {reason}, start-up + first token "
          f"{(t_first or t_end) - t0:.2f} s, {max(n - 1, 0) / decode_s if decode_s else 0:.1f} "
          f"tokens/s after]", file=sys.stderr)
    return 0 if reason is not None and str(reason) != "error" else 1

"""``enginecore generate``: stream one answer from a model to the terminal."""

from __future__ import annotations

import argparse
import sys
import time


def run_generate(args: argparse.Namespace) -> int:
    from enginecore.config import EngineArgs
    from enginecore.core.engine_core import EngineCore
    from enginecore.frontend.detokenizer import DetokenizerFactory
    from enginecore.model.tokenizer import Tokenizer
    from enginecore.protocol import EngineCoreRequest
    from enginecore.sampling_params import SamplingParams

    t0 = time.perf_counter()
    config = EngineArgs(model=args.model, dtype=args.dtype, device=args.device,
                        max_num_seqs=1, kv_cache_memory_bytes=256 << 20).create_engine_config()
    tokenizer = Tokenizer.from_dir(config.model_config.model_path)
    engine = EngineCore(config)
    if args.chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    engine.add_request(EngineCoreRequest("cli", ids, params))
    decoder = DetokenizerFactory(tokenizer).new(True, ids)
    t_first = None
    n = 0
    reason = None
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
                sys.stdout.flush()
                if o.finish_reason is not None:
                    reason = o.finish_reason
    t_end = time.perf_counter()
    sys.stdout.write("\n")
    decode_s = t_end - (t_first or t_end)
    print(f"[{config.model_config.model}: {n} tokens, finish {reason}, start-up + first token "
          f"{(t_first or t_end) - t0:.2f} s, {max(n - 1, 0) / decode_s if decode_s else 0:.1f} "
          f"tokens/s after]", file=sys.stderr)
    engine.shutdown()
    return 0 if reason is not None and str(reason) != "error" else 1

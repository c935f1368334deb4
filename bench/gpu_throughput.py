"""Greedy decode throughput on one device: enginecore's EngineCore next to
transformers' ``generate`` on the same random weights and prompts, in one run.
Part of ``make gpu-check`` (bench/gpu_check.sh); ratios are what to read.

The model is made here (no hub, no network): a Llama with SmolLM2-135M's
shape (30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49152) and
random weights. Output: throughput.json and throughput.md in --out.

    python bench/gpu_throughput.py --out DIR             # CUDA, bfloat16
    python bench/gpu_throughput.py --device cpu --shape tiny --batches 1,4 \\
        --prompt-len 16 --output-len 8 --dtype float32 --out DIR   # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=2048, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=512, tie_word_embeddings=False),
}


def make_model(path: str, shape: str) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, **SHAPES[shape])
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the init's: fewer near-ties in bf16
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_enginecore(eng, batch, plen, olen, vocab, device) -> tuple[float, list[list[int]]]:
    from enginecore import EngineCoreRequest, SamplingParams

    sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(batch, plen, vocab)):
        eng.add_request(EngineCoreRequest(str(i), p, SamplingParams(
            max_tokens=olen, temperature=0, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            for o in outs.outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    sync(device)
    return time.perf_counter() - t0, [out[str(i)] for i in range(batch)]


def run_transformers(model, batch, plen, olen, vocab, device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts(batch, plen, vocab), device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=olen,
                             min_new_tokens=olen, do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0, out[:, plen:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default="gpu-check-results")
    a = ap.parse_args()
    import transformers

    from enginecore import EngineArgs, EngineCore

    os.makedirs(a.out, exist_ok=True)
    batches = [int(b) for b in a.batches.split(",")]
    vocab = SHAPES[a.shape]["vocab_size"]
    tdtype = getattr(torch, a.dtype)
    with tempfile.TemporaryDirectory() as model_dir:
        make_model(model_dir, a.shape)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=tdtype).to(a.device).eval()
        per_block, tokens = 16, max(batches) * (a.prompt_len + a.output_len)
        eng = EngineCore(EngineArgs(
            model=model_dir, device=a.device, dtype=a.dtype, block_size=per_block,
            max_model_len=a.prompt_len + a.output_len + per_block,
            num_gpu_blocks_override=tokens // per_block + max(batches) + 8,
            max_num_seqs=max(256, *batches)).create_engine_config())
        # Warm-up both (kernels, allocator, transformers' first-call work).
        run_enginecore(eng, 2, a.prompt_len, 4, vocab, a.device)
        run_transformers(ref, 2, a.prompt_len, 4, vocab, a.device)
        rows = []
        for b in batches:
            t_ec, ec_tokens = run_enginecore(eng, b, a.prompt_len, a.output_len, vocab, a.device)
            t_hf, hf_tokens = run_transformers(ref, b, a.prompt_len, a.output_len, vocab,
                                               a.device)
            n = b * a.output_len
            first = sum(x[0] == y[0] for x, y in zip(ec_tokens, hf_tokens)) / b
            rows.append(dict(batch=b, enginecore_tok_s=n / t_ec, transformers_tok_s=n / t_hf,
                             ratio=t_hf / t_ec, enginecore_s=t_ec, transformers_s=t_hf,
                             first_token_agreement=first))
            print(f"batch {b}: enginecore {n / t_ec:.0f} tok/s, transformers {n / t_hf:.0f} "
                  f"tok/s, ratio {t_hf / t_ec:.2f}x, first tokens agree {first:.0%}", flush=True)
        eng.shutdown()
    device_name = (torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu")
    result = dict(device=device_name, torch=torch.__version__,
                  transformers=transformers.__version__, dtype=a.dtype, shape=a.shape,
                  prompt_len=a.prompt_len, output_len=a.output_len, rows=rows)
    with open(os.path.join(a.out, "throughput.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(a.out, "throughput.md"), "w") as f:
        f.write(f"Greedy decode, {a.shape} shape (random weights), {a.dtype}, on {device_name}, "
                f"torch {torch.__version__}, prompt {a.prompt_len}, output {a.output_len} "
                "tokens per request.\n\n| batch | enginecore tok/s | transformers tok/s | "
                "ratio | first tokens agree |\n|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['batch']} | {r['enginecore_tok_s']:.0f} | "
                    f"{r['transformers_tok_s']:.0f} | {r['ratio']:.2f}x | "
                    f"{r['first_token_agreement']:.0%} |\n")


if __name__ == "__main__":
    main()

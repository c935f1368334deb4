"""The default model (SmolLM2-135M-Instruct GGUF): golden tokens, transformers
parity on the dequantized weights, the LLM API and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from enginecore import FinishReason, SamplingParams
from enginecore.entrypoints.llm import LLM
from enginecore.model.model_info import resolve_model_path

GOLDEN = [504, 3575, 282, 4649, 314, 7042, 30, 2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm32():
    with LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20) as llm:
        yield llm


def test_golden_chat_answer(llm32):
    (out,) = llm32.chat(QUESTION, SamplingParams(max_tokens=32, temperature=0))
    comp = out.outputs[0]
    assert comp.token_ids == GOLDEN
    assert comp.text == "The capital of France is Paris."
    assert comp.finish_reason == "stop"


def test_gguf_matches_transformers_on_dequantized_weights(llm32):
    import transformers

    _, path = resolve_model_path(None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = llm32.get_tokenizer()
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is a city in",
               "1, 2, 3, 4,"]
    outs = llm32.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        got, want = out.outputs[0].token_ids, gen[0, len(ids):].tolist()
        if got != want:
            # Only a numerical tie may break parity: at the first difference the
            # reference must rate our token within float32 noise of its own choice
            # (30 layers summed in another order differ by ~1e-4 in the logits).
            k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            with torch.no_grad():
                logits = ref(torch.tensor([ids + want[:k]])).logits[0, -1]
            gap = float(logits[want[k]] - logits[got[k]])
            assert gap < 5e-3, (prompt, k, got, want, gap)


def test_llm_generate_shapes_and_token_prompts(llm32):
    outs = llm32.generate(
        ["Hello", {"prompt_token_ids": [1, 9690, 198]}],
        [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=3, temperature=0.7, seed=1, logprobs=2, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 3]
    assert outs[1].prompt_token_ids == [1, 9690, 198] and outs[1].prompt is None
    lps = outs[1].outputs[0].logprobs
    assert len(lps) == 3 and all(tid in pos for tid, pos in zip(outs[1].outputs[0].token_ids, lps))
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(TypeError, match="prompt"):
        llm32.generate([42])


def test_default_dtype_is_bfloat16_here_and_answers(tmp_path):
    with LLM(max_model_len=512, kv_cache_memory_bytes=32 << 20) as llm:
        assert llm.config.model_config.dtype in ("bfloat16", "float32")
        (out,) = llm.chat(QUESTION, SamplingParams(max_tokens=16, temperature=0))
        assert "Paris" in out.outputs[0].text
        assert FinishReason.STOP.name.lower() == out.outputs[0].finish_reason


def test_cli_generate_streams_the_answer():
    proc = subprocess.run(
        [sys.executable, "-m", "enginecore.entrypoints.cli", "generate",
         "What is the capital of France?", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stderr


def test_llm_in_process_option():
    with LLM(multiprocess_mode=False, dtype="float32", max_model_len=512,
             kv_cache_memory_bytes=32 << 20) as llm:
        from enginecore.client import InprocClient

        assert isinstance(llm.client, InprocClient)
        (out,) = llm.chat(QUESTION, SamplingParams(max_tokens=16, temperature=0))
        assert out.outputs[0].token_ids == GOLDEN

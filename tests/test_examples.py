"""The ports of vLLM's examples/offline_inference scripts run on the default model
(each a subprocess, as a user runs it; small max_tokens)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "offline_inference")
PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")}
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == \
        ["basic.py", "chat.py", "generate.py"]


def test_basic():
    out = _run("basic.py")
    for prompt in PROMPTS:
        assert f"Prompt:    {prompt!r}" in out
    assert len(re.findall(r"^Output:    ['\"].+['\"]$", out, re.MULTILINE)) == 4


def test_generate_with_sampling_params():
    out = _run("generate.py", "--max-tokens", "6", "--temperature", "0", "--top-k", "5")
    assert len(re.findall(r"^Generated text: ['\"].+['\"]$", out, re.MULTILINE)) == 4
    for prompt in PROMPTS:
        assert f"Prompt: {prompt!r}" in out


def test_chat_with_and_without_a_template(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                        "{% endfor %}[assistant]")
    out = _run("chat.py", "--max-tokens", "4", "--temperature", "0",
               "--chat-template-path", str(template))
    assert out.count("Generated text:") == 1 + 10 + 10
    assert "<|im_start|>user\\nHello<|im_end|>" in out  # the model's own template
    assert "[user] Hello\\n" in out  # then the given one


@pytest.mark.parametrize("script", ["basic.py", "chat.py", "generate.py"])
def test_only_imports_and_model_differ_from_vllm(script):
    with open(os.path.join(EXAMPLES, script)) as f:
        text = f.read()
    assert "vllm" not in re.sub(r"^#.*$", "", text, flags=re.MULTILINE)

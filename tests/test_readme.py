"""The Python examples of README's "Porting from vLLM" section run, unchanged but
for the model (the tiny chat model instead of SmolLM2), in a fresh interpreter as
a script does (``__main__``, the engine in its spawned process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def porting_blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Porting from vLLM", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_porting_examples_run(tiny_chat_model, tmp_path):
    blocks = porting_blocks()
    assert blocks and all(HUB_NAME in b for b in blocks)
    for i, block in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(block.replace(HUB_NAME, tiny_chat_model))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=240, cwd=tmp_path)
        assert done.returncode == 0, f"README block {i} failed:\n{done.stderr[-4000:]}"
        assert i > 0 or "enginecore:spec_decode_num_draft_tokens" in done.stdout, done.stdout

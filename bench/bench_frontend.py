"""The front-end's per-step output loop (``OutputProcessor.process_outputs``) on
both twins: ``frontend/step_loop.py`` (python) and ``frontend/step_loop_cy.pyx``
(native), at 64 / 256 / 1024 streams decoding one token each per step.

Real text on the default model's tokenizer: every stream replays the tokens of
English + multi-byte prose (so UTF-8 characters split across tokens), one token
per step, DELTA outputs (what a streaming server asks for). ``plain``: no stop
strings; ``stop``: two stop strings that never match, so every step searches and
holds back. Each round is one step over all streams, with fresh outputs.

Run (with the locks, see TEAM.md):
    pytest bench/bench_frontend.py --benchmark-group-by=group \
        --benchmark-columns=min,median,mean,rounds
"""

from __future__ import annotations

import pytest

from enginecore.frontend.output_processor import OutputProcessor
from enginecore.model.model_info import resolve_model_path
from enginecore.model.tokenizer import Tokenizer
from enginecore.protocol import EngineCoreOutput, EngineCoreRequest
from enginecore.sampling_params import RequestOutputKind, SamplingParams

TEXT = ("The capital of France is Paris. Its museums — the Louvre, the Musée d'Orsay — draw "
        "millions; 日本語のテキストも少し。 Emoji 🎉 and café naïve résumé. ") * 8
ROUNDS = 200


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_path(None)[1])


@pytest.mark.parametrize("variant", ["plain", "stop"])
@pytest.mark.parametrize("streams", [64, 256, 1024])
def test_frontend_step(benchmark, path, tokenizer, streams, variant):
    op = OutputProcessor(tokenizer)
    assert op.uses_native_loop == (path == "native")
    stop = ["</answer>", "\nUser:"] if variant == "stop" else None
    sp = SamplingParams(max_tokens=None, stop=stop, output_kind=RequestOutputKind.DELTA)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rids = [f"cmpl-{i:08d}-0" for i in range(streams)]
    for rid in rids:
        op.add_request(EngineCoreRequest(rid, [1, 2, 3], sp), None)
    # One step's outputs per round, made up front (the client decodes them in reality).
    steps = [[EngineCoreOutput(rid, [ids[(r + i) % len(ids)]]) for i, rid in enumerate(rids)]
             for r in range(ROUNDS + 1)]
    it = iter(steps)

    def step():
        return op.process_outputs(next(it), 1.0)

    benchmark.group = f"frontend_step[{streams}-{variant}]"
    res = benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    assert len(res.request_outputs) == streams  # every stream produced its delta

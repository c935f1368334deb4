"""Executors for process tests; module-level so the spawned engine can import them."""

from __future__ import annotations

from enginecore.executor import SyntheticExecutor


class FailAfterExecutor(SyntheticExecutor):
    """Fails on its 4th model step, as a broken device would."""

    def execute_model(self, so, non_block=False):
        if self.num_steps >= 3:
            self._mark_failed()
            raise RuntimeError("injected executor failure")
        return super().execute_model(so, non_block)


class LogprobsExecutor(SyntheticExecutor):
    """Returns 20 logprobs per token: large output frames (>= 64 KiB per step)."""

    def _run(self, so):
        out = super()._run(so)
        out.logprobs = [
            ([[t] + list(range(20))], [[-0.5] + [-float(i) for i in range(20)]], [1])
            if t_list else None
            for t_list in out.sampled_token_ids for t in (t_list or [0])[:1]
        ]
        return out

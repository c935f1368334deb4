"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine core died (crash, kill, executor failure); no request will finish."""

    def __init__(self, message: str = "Engine core died; see the engine's log for why") -> None:
        super().__init__(message)


class EngineGenerateError(RuntimeError):
    """One request failed while the engine itself lives on."""

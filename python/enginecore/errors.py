"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine core died (crash, kill, executor failure); no request will finish."""

    def __init__(self, message: str = "Engine core died; see the engine's log for why") -> None:
        super().__init__(message)


class EngineGenerateError(RuntimeError):
    """One request failed while the engine itself lives on."""



# The most of a rejected value an error message quotes: a hostile value may be
# megabytes, and error bodies are logged and sent back.
MAX_QUOTED_CHARS = 80


def short_repr(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """A repr of ``value`` of at most about ``limit`` characters: the first few
    items of a container, the ends of a long string (never the whole value)."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    r.maxlist = r.maxdict = r.maxset = r.maxtuple = 8
    r.maxlevel = 3
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

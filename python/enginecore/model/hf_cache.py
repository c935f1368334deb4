"""Hub-style model names (``org/name``) found in the local Hugging Face cache.

Only what is already on disk is used (``local_files_only``): enginecore never
reaches a model hub. The cache directory is read from the environment at each
call, as huggingface_hub documents it (HF_HUB_CACHE, then HUGGINGFACE_HUB_CACHE,
then HF_HOME/hub, then $XDG_CACHE_HOME/huggingface/hub, then
~/.cache/huggingface/hub), so a variable set after import still counts.
"""

from __future__ import annotations

import os


def hf_hub_cache_dir() -> str:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(os.path.expandvars(explicit))
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.path.join(xdg, "huggingface")
    return os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` or ``name``: no absolute path, no ``.``/``~`` start, at most one slash."""
    if not name or name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return False
    return all(part and part not in (".", "..") for part in name.split("/"))


def find_cached_snapshot(repo_id: str) -> str | None:
    """The snapshot directory of ``repo_id`` (its default revision) in the local
    cache, or None when the cache does not hold it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, cache_dir=hf_hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None

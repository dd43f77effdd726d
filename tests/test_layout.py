"""The layout's rules, read off the source with `ast` (every import, at any depth), and the API server's promise of no
torch, checked on a real import and on a real server process.

    engine ─► compile ─► backends        engine ─► cache
    engine/models ─► backends (never compile: compilation wraps a model from outside)
    engine/serving ─► messages only of the core: never engine/core, engine/worker, torch
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.server import Server

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"engine": "kiln.engine", "compile": "kiln.compile", "backends": "kiln.backends", "cache": "kiln.cache"}


def imports(path: Path, runtime_only: bool = False) -> list[tuple[int, str]]:
    """Every module `path` imports (a `from x import y` as x.y as well as x), with its line; `runtime_only` leaves
    out the imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(child) for stmt in node.body for child in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def violations(folder: str, forbidden: tuple[str, ...], runtime_only: bool = False) -> list[str]:
    """`file:line imports module` for each import under `folder` of a module in (or under) `forbidden`."""
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(folder)
        for line, module in imports(path, runtime_only)
        if any(module == f or module.startswith(f + ".") for f in forbidden)
    ]


def test_the_source_folders_are_the_packages():
    """Each folder with Python files is a package the project installs (pyproject's list, nothing left out)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, package in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
        for path in sources(folder):
            assert (path.parent / "__init__.py").exists(), f"{path.relative_to(ROOT)} is in no package"
    assert found == listed


def test_the_lower_layers_never_import_the_engine():
    for folder in ("compile", "backends", "cache"):
        assert violations(folder, ("kiln.engine",)) == []


def test_imports_flow_one_way_below_the_engine():
    """backends import neither compile nor cache; cache imports no other Kiln package."""
    assert violations("backends", ("kiln.compile", "kiln.cache")) == []
    assert violations("cache", ("kiln.compile", "kiln.backends")) == []


def test_models_never_import_compile():
    assert violations("engine/models", ("kiln.compile",)) == []


def test_the_api_server_never_imports_torch_or_the_engine_core():
    """It talks to the core only through `kiln.engine.messages`, and starts it as a program of its own."""
    forbidden = ("torch", "triton", "kiln.engine.core", "kiln.engine.worker", "kiln.compile", "kiln.backends.attention")
    assert violations("engine/serving", forbidden) == []
    # and what it imports of the engine's top level imports none of them either
    for shared in ("engine/config.py", "engine/messages.py", "engine/sampling_params.py", "engine/outputs.py"):
        assert not [m for _, m in imports(ROOT / shared) if m.split(".")[0] in ("torch", "triton")], shared


def test_the_worker_imports_the_core_for_types_only():
    """The model runner and sampler run a batch the scheduler made: they know its types, not the scheduler."""
    assert violations("engine/worker", ("kiln.engine.core",), runtime_only=True) == []


def test_nothing_is_imported_by_name():
    """No `importlib.import_module`, `__import__` or `find_spec` in the product: what a module needs it imports, or
    is handed."""
    calls = []
    for folder in PACKAGES:
        for path in sources(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = ast.unparse(node.func)
                    if name.endswith(("import_module", "__import__", "find_spec")):
                        calls.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {name}")
    assert calls == []


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers."""
    shared = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, module in imports(path)
        if module.split(".")[-1].startswith("test_") or module.split(".")[0] in ("conftest", "tests")
    ]
    assert shared == []


def test_the_api_server_module_loads_without_torch():
    code = (
        "import sys\n"
        "import kiln.engine.cli, kiln.engine.serving.api_server\n"
        "from kiln.engine import EngineConfig, SamplingParams\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "assert not loaded, loaded\n"
        "assert not [m for m in sys.modules if m.startswith(('kiln.engine.core', 'kiln.engine.worker'))]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_serving_api_server_process_has_no_torch_loaded(tiny_llama_dir):
    """A real `kiln serve` with a model directory, after a completion: its own process maps no torch library (the
    engine core, its child, holds torch; the tokenizer is read with the class the engine core resolved)."""
    server = Server(tiny_llama_dir)
    try:
        assert server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4})[0] == 200
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps
        engine_maps = Path(f"/proc/{server.engine_pid()}/maps").read_text()
        assert "libtorch" in engine_maps  # (the check can see torch where it is)
    finally:
        server.stop()


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]])
def test_kiln_help_imports_no_torch(argv):
    code = (
        "import sys\n"
        "from kiln.engine.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]

"""Kiln's Dynamo backend: split the traced graph at attention, compile each compute piece with Inductor.

Dynamo calls it once, at start-up, with the whole model's FX graph (token count symbolic). It cuts the
graph at every `kiln::unified_attention` (`split.py`), then walks the split graph with fake tensors to
learn each piece's input shapes and hands each compute piece to Inductor's `standalone_compile` — or
loads that piece's artifact from the disk cache. Identical middle layers have identical piece graphs
(weights are inputs, not constants), so one artifact serves them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx.node import _get_qualified_name

from kiln.backends.kernels import pdl
from kiln.compile.cache import CompileCache
from kiln.compile.counters import CompileCounters
from kiln.compile.cudagraph import GraphPool, PiecewiseCudaGraphs
from kiln.compile.saved_graph import Unsaveable, describe
from kiln.compile.split import call_attention_directly, split_at_attention

logger = logging.getLogger("kiln")


class CompiledPiece(torch.nn.Module):
    """A compiled compute piece in the split graph; replays a CUDA graph per size when asked to."""

    def __init__(self, compiled, single_output: bool, pool: GraphPool) -> None:
        super().__init__()
        self.compiled = compiled
        self.graphs = PiecewiseCudaGraphs(self._run, pool)
        self.single_output = single_output

    def _run(self, *args):
        out = self.compiled(*args)
        # NOTE: an artifact loaded from disk returns its outputs as a sequence even when the piece
        # returns one tensor; the split graph expects the piece's own structure.
        if self.single_output and isinstance(out, list | tuple):
            (out,) = out
        return out

    def forward(self, *args):
        return self.graphs(*args)


class KilnBackend:
    def __init__(self, cache: CompileCache, counters: CompileCounters) -> None:
        self.cache = cache
        self.counters = counters
        self.split: torch.fx.GraphModule | None = None  # the traced forward, its pieces compiled
        self.graph_pool = GraphPool()  # the full graphs' and the pieces' graphs'
        self.artifacts: dict[str, Any] = {}  # each distinct compute piece's, by its hash
        self.saved: dict[str, Any] | None = None  # the split graph as `saved_graph.describe` writes it down

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> torch.fx.GraphModule:
        self.counters.dynamo_traces += 1
        split, compute, attention = split_at_attention(gm)
        self.counters.compute_pieces = len(compute)
        self.counters.attention_ops = len(attention)
        fake_mode = detect_fake_mode()
        fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        compiler = _PieceCompiler(split, compute, self)
        with fake_mode:
            compiler.run(*fake_args)
        call_attention_directly(split, attention)
        self.counters.unique_pieces = len(compiler.by_hash)
        self.cache.write_text("split_graph.py", _readable(split, compiler.codes, len(attention)))
        self.split = split
        self.artifacts = compiler.by_hash
        try:
            sources = _sources(gm)
            example = {name: example_inputs[sources.index(f"L['{name}']")] for name in ("input_ids", "positions")}
            self.saved = describe(split, sources, compiler.pieces, example)
        except (Unsaveable, ValueError) as e:
            logger.warning("the split graph cannot be saved (%s): every start will trace it", e)
        return split

    def release_graphs(self) -> None:
        """Drop every piece's CUDA graphs (the pieces themselves stay)."""
        for piece in self.split.children() if self.split is not None else ():
            if isinstance(piece, CompiledPiece):
                piece.graphs.graphs.clear()
        self.graph_pool.reset()

    def compile_piece(self, piece: torch.fx.GraphModule, args: list[Any], digest: str):
        """The piece's Inductor artifact: from the disk cache under `digest`, or compiled and stored."""
        from torch._inductor import standalone_compile  # noqa: PLC0415

        with self.counters.timed("cache_load_seconds"):
            artifact = self.cache.load(digest)
        if artifact is not None:
            self.counters.cache_hits += 1
            return artifact
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        use_pdl = any(pdl.enabled(t) for t in tensors)  # (fake tensors: their devices are the piece's)
        with self.counters.timed("inductor_seconds"), inductor_settings(use_pdl):
            artifact = standalone_compile(piece, list(args), dynamic_shapes="from_tracing_context")
        self.counters.inductor_compiles += 1
        self.cache.save(digest, artifact)
        return artifact


@contextlib.contextmanager
def inductor_settings(use_pdl: bool):
    """Kiln's Inductor settings while a piece compiles: its heuristics (`inductor_choices.py`) and, with `use_pdl`
    (`kiln.backends.kernels.pdl`), programmatic dependent launch for the generated kernels where this torch's Inductor
    has the switch (`triton.enable_pdl`)."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415
    from torch._inductor.virtualized import V  # noqa: PLC0415

    from kiln.compile.inductor_choices import KilnChoices  # noqa: PLC0415

    # NOTE: the handler is what Inductor consults; the class setting (where this torch has it) puts the choice in
    # Inductor's own cache key, which otherwise would hand back a piece compiled with the default heuristics.
    patches = {"inductor_choices_class": KilnChoices} if hasattr(inductor_config, "inductor_choices_class") else {}
    if use_pdl and hasattr(inductor_config.triton, "enable_pdl"):
        patches["triton.enable_pdl"] = True
    with inductor_config.patch(patches), V.set_choices_handler(KilnChoices()):
        yield


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake tensors; at each compute piece, compiles it for the shapes seen."""

    def __init__(self, split: torch.fx.GraphModule, compute: list[str], backend: KilnBackend) -> None:
        super().__init__(split)
        self.compute = set(compute)
        self.backend = backend
        self.by_hash: dict[str, Any] = {}
        self.pieces: dict[str, tuple[str, bool]] = {}  # compute piece -> (its hash, whether it returns one tensor)
        self.codes: dict[str, str] = {}  # each piece's code, kept for the debugging dump

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        if target in self.compute:
            piece = getattr(self.module, target)
            self.codes[target] = piece.code
            digest = piece_hash(piece, args)
            if digest not in self.by_hash:
                self.by_hash[digest] = self.backend.compile_piece(piece, list(args), digest)
            self.pieces[target] = (digest, isinstance(out, torch.Tensor))
            setattr(
                self.module,
                target,
                CompiledPiece(self.by_hash[digest], isinstance(out, torch.Tensor), self.backend.graph_pool),
            )
        return out


def _sources(gm: torch.fx.GraphModule) -> list[str]:
    """Dynamo's source of each of the graph's inputs, in order (`L['input_ids']`, `L['model']._modules[...]...`)."""
    sources = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            grapharg = node.meta.get("grapharg")
            if grapharg is None or grapharg.source is None:
                raise Unsaveable(f"input {node.name} has no source")
            name = grapharg.source.name
            sources.append(name() if callable(name) else name)  # (a method in older torch)
    return sources


def piece_hash(piece: torch.fx.GraphModule, args: list[Any]) -> str:
    """A name-independent fingerprint of a piece: its ops and data flow, and its inputs' shapes.

    Node names carry layer indices (`..._layers_modules_3_...`), so two identical layers differ only in
    names; nodes are renumbered in order before hashing.
    """
    names: dict[torch.fx.Node, str] = {}
    lines = []
    for i, node in enumerate(piece.graph.nodes):
        names[node] = f"n{i}"
        target = node.target if isinstance(node.target, str) else _target_name(node.target)
        if node.op in ("placeholder", "get_attr"):
            target = node.op
        rendered = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
        lines.append(f"{node.op} {target} {rendered!r}")
    for a in args:
        lines.append(f"{a.dtype} {tuple(a.shape)} {a.stride()}" if isinstance(a, torch.Tensor) else repr(a))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]


def _target_name(target) -> str:
    try:
        return _get_qualified_name(target)
    except Exception:
        return str(target)


def _readable(split: torch.fx.GraphModule, piece_codes: dict[str, str], num_attention: int) -> str:
    parts = [f"# split graph: {len(piece_codes)} compute pieces, {num_attention} attention ops\n", split.code]
    for name, module in split.named_children():
        kind = "compute (Inductor)" if name in piece_codes else "attention (eager)"
        parts.append(f"\n# ---- {name}: {kind} ----\n{piece_codes.get(name) or module.code}")
    return "\n".join(parts)

"""The traced, split forward written down as data, so that a warm start runs it without tracing again.

Dynamo's trace gives the same graph on every start with one cache key (the key covers everything that shapes
it), and it costs seconds. After the trace, Kiln saves the split graph as
`forward.json` beside the pieces' artifacts:

    inputs   where each of the graph's inputs comes from: Dynamo's source for it, a Python expression over the
             traced function's locals (`L['model']._modules['model']...._parameters['weight']`, `L['input_ids']`,
             `L['positions'].storage_offset()`); the model's are bound once, the others evaluated every call
    graph    the top graph's nodes: the pieces' calls and the getitems between them
    pieces   per piece: its Inductor artifact's hash (compute) or its own nodes (attention)
    traced   the dtype, strides and (unless symbolic) storage offset the inputs were traced with

A warm start rebuilds the same FX graph from it, loads the artifacts and never enters Dynamo. The start that
traced runs the rebuilt graph as well, so every start runs one path. A graph with anything else in it (another
function between the pieces, an input from a global) is not saved: those starts trace as before.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.backends.attention.aux_hidden import save_hidden
from kiln.backends.attention.op import attend
from kiln.backends.linear_attention.op import gated_delta_net

VERSION = 1
FUNCTIONS = {
    "_operator.getitem": operator.getitem,
    "kiln.backends.attention.op.attend": attend,
    "kiln.backends.linear_attention.op.gated_delta_net": gated_delta_net,
    "kiln.backends.attention.aux_hidden.save_hidden": save_hidden,
}
NAMES = {fn: name for name, fn in FUNCTIONS.items()}
INPUTS = ("input_ids", "positions")  # the traced function's arguments; `model` is its closure


class Unsaveable(Exception):
    """The split graph holds something `forward.json` cannot describe."""


def describe(
    split: torch.fx.GraphModule,
    sources: list[str],
    compute: dict[str, tuple[str, bool]],
    example: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """The saved form of `split` (attention pieces already calling `attend`): `sources`, Dynamo's source of each
    input in order; `compute`, each compute piece's (artifact hash, returns one tensor); `example`, the traced
    call's input_ids and positions."""
    pieces: dict[str, Any] = {}
    for name, module in split.named_children():
        if name in compute:
            digest, single = compute[name]
            pieces[name] = {"compute": digest, "single_output": single}
        elif isinstance(module, torch.fx.GraphModule):
            pieces[name] = {"graph": _nodes(module.graph)}
        else:
            raise Unsaveable(f"piece {name} is a {type(module).__name__}")
    for source in sources:
        if not source.startswith(("L['model']", *(f"L['{n}']" for n in INPUTS))):
            raise Unsaveable(f"an input from {source}")
    (output,) = [node for node in split.graph.nodes if node.op == "output"]
    if not (isinstance(output.args[0], tuple | list) and len(output.args[0]) == 1):
        raise Unsaveable("the forward returns more than the hidden states")
    traced = {
        name: {"dtype": str(t.dtype), "stride": list(t.stride()), "offset": t.storage_offset()}
        for name, t in example.items()
    }
    for name in INPUTS:
        if f"L['{name}'].storage_offset()" in sources:
            traced[name]["offset"] = None  # symbolic: any offset
    return {"version": VERSION, "inputs": sources, "graph": _nodes(split.graph), "pieces": pieces, "traced": traced}


def rebuild(saved: dict[str, Any], model: nn.Module, compute_piece: Callable[[str, bool], nn.Module]) -> SavedForward:
    """`forward(input_ids, positions)` from the saved form; `compute_piece(hash, single_output)` makes each compute
    piece's module. Raises Unsaveable for a form it does not know."""
    if saved.get("version") != VERSION:
        raise Unsaveable(f"forward.json version {saved.get('version')}")
    root = nn.Module()
    for name, piece in saved["pieces"].items():
        if "compute" in piece:
            module = compute_piece(piece["compute"], piece["single_output"])
        else:
            module = torch.fx.GraphModule(nn.Module(), _graph(piece["graph"]))
        root.add_module(name, module)
    split = torch.fx.GraphModule(root, _graph(saved["graph"]))
    return SavedForward(split, saved["inputs"], saved["traced"], model)


class SavedForward:
    """The rebuilt split graph, called as the traced function was: its inputs found from their sources."""

    def __init__(self, split: torch.fx.GraphModule, sources: list[str], traced: dict, model: nn.Module) -> None:
        self.split = split
        self.traced = traced
        self.args: list[Any] = []
        self.per_call: list[tuple[int, Callable]] = []  # (position, source as a function of L)
        for i, source in enumerate(sources):
            # NOTE: Dynamo's sources are Python expressions over the frame's locals `L`; this cache folder's
            # artifacts are executable code already, so evaluating its expressions trusts nothing more.
            getter = eval(f"lambda L: {source}", {})  # noqa: S307
            if source.startswith("L['model']"):
                self.args.append(getter({"model": model}))  # a weight or buffer: the same tensor every call
            else:
                self.args.append(None)
                self.per_call.append((i, getter))
        self.checked = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.checked:
            self._check(input_ids=input_ids, positions=positions)
        args = list(self.args)
        scope = {"input_ids": input_ids, "positions": positions}
        for i, getter in self.per_call:
            args[i] = getter(scope)
        (out,) = self.split(*args)
        return out

    def _check(self, **inputs: torch.Tensor) -> None:
        """The first call's inputs are laid out as the traced ones were (what Dynamo's guards would check)."""
        for name, t in inputs.items():
            want = self.traced[name]
            offset = want["offset"] if want["offset"] is not None else t.storage_offset()
            got = {"dtype": str(t.dtype), "stride": list(t.stride()), "offset": t.storage_offset()}
            if got != {**want, "offset": offset}:
                raise RuntimeError(f"the compiled forward was traced with {name} {want}, called with {got}")
        self.checked = True


def _nodes(graph: torch.fx.Graph) -> list[list]:
    rows = []
    for node in graph.nodes:
        if node.op == "call_function":
            if node.target not in NAMES:
                raise Unsaveable(f"a call of {node.target}")
            target = NAMES[node.target]
        elif node.op in ("placeholder", "call_module", "output"):
            target = node.target
        else:
            raise Unsaveable(f"a {node.op} node")
        rows.append([node.op, node.name, target, _encode(node.args), _encode(node.kwargs)])
    return rows


def _graph(rows: list[list]) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for op, name, target, args, kwargs in rows:
        if op == "call_function":
            if target not in FUNCTIONS:
                raise Unsaveable(f"a call of {target}")
            target = FUNCTIONS[target]
        elif op not in ("placeholder", "call_module", "output"):
            raise Unsaveable(f"a {op} node")
        env[name] = graph.create_node(op, target, _decode(args, env), _decode(kwargs, env), name)
    return graph


def _encode(a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        return {"node": a.name}
    if isinstance(a, tuple | list):
        return {type(a).__name__: [_encode(x) for x in a]}
    if isinstance(a, dict):
        return {"dict": {k: _encode(v) for k, v in a.items()}}
    if a is None or isinstance(a, bool | int | float | str):
        return a
    raise Unsaveable(f"an argument {a!r}")


def _decode(a: Any, env: dict[str, torch.fx.Node]) -> Any:
    if isinstance(a, dict):
        ((kind, value),) = a.items()
        if kind == "node":
            return env[value]
        if kind == "dict":
            return {k: _decode(v, env) for k, v in value.items()}
        return (tuple if kind == "tuple" else list)(_decode(x, env) for x in value)
    return a

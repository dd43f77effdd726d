"""A tool parameter written as raw text (Qwen3-Coder's `<parameter=P>value</parameter>`) read as the JSON value the
tool's schema asks for, as vLLM's `qwen3_coder` parser reads it: a string stays the text; an integer, number, boolean,
object, array or null is parsed; text that is none of the types the schema allows stays a string.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

# JSON Schema's type names, and the names models' tool definitions use for them (vLLM reads them all)
_TYPE_NAMES = (
    ("string", ("string", "str", "text", "varchar", "char", "enum")),
    ("integer", ("int", "uint", "long", "short", "unsigned")),
    ("number", ("num", "float", "double")),
    ("boolean", ("boolean", "bool", "binary")),
    ("object", ("object", "dict")),
    ("array", ("array", "arr", "list")),
    ("null", ("null",)),
)
_INTEGER = re.compile(r"[-+]?[0-9]+")
_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, in its order (`type` as a name or a list, else the options of
    `anyOf` / `oneOf`); a schema that names none allows text."""
    if not isinstance(schema, dict):
        return ["string"]
    named = schema.get("type")
    if named is None:
        options = schema.get("anyOf") or schema.get("oneOf")
        options = options if isinstance(options, list) else []
        named = [o.get("type") for o in options if isinstance(o, dict)]
    if isinstance(named, str):
        named = [named]
    types: list[str] = []
    for name in named if isinstance(named, list) else []:
        if not isinstance(name, str):
            continue
        name = name.strip().lower()
        kind = next((k for k, prefixes in _TYPE_NAMES if name.startswith(prefixes)), None)
        if kind is not None and kind not in types:
            types.append(kind)
    return types or ["string"]


def schema_value(text: str, schema: Any) -> Any:
    """`text` as the first of the schema's types it reads as (`schema` None: a parameter the tool does not have, a
    string). `null` (or Python's `None`, as Qwen's templates render it) is null for any type but a string."""
    types = schema_types(schema) if schema is not None else ["string"]
    if text.strip().lower() in ("null", "none") and ("null" in types or types[0] != "string"):
        return None
    for kind in types:
        value = _read(text, kind)
        if value is not _NOT:
            return value
    return text


_NOT = object()  # the text is not of that type


def _read(text: str, kind: str) -> Any:
    stripped = text.strip()
    if kind == "string":
        return text
    if kind in ("integer", "number") and _INTEGER.fullmatch(stripped):
        try:
            return int(stripped)
        except ValueError:  # (past Python's 4,300 digits)
            return _NOT
    if kind == "number":
        if not _NUMBER.fullmatch(stripped):
            return _NOT
        number = float(stripped)
        if not math.isfinite(number):  # (JSON has no infinities: "1e999" stays text)
            return _NOT
        return int(number) if number.is_integer() else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(stripped.lower(), _NOT)
    if kind in ("object", "array"):
        wanted = dict if kind == "object" else list
        value = _json_or_python(stripped)
        return value if isinstance(value, wanted) else _NOT
    return _NOT


def _json_or_python(text: str) -> Any:
    """JSON, or a Python literal (a model trained on templates that rendered dicts with str() writes {'k': 'v'}), as
    long as JSON can carry it (no sets, bytes or infinities)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
        return value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")

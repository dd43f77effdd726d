"""A constraint parsed without a tokenizer (xgrammar; no model code): what the API server's check workers run before
it admits a request, and what the engine's compile workers compile for its tokenizer (`compile_worker`).

A JSON schema is refused before xgrammar sees it when it nests past MAX_SCHEMA_DEPTH (the parse's time grows with
it) or uses a keyword xgrammar 0.2.9 passes over without enforcing (`IGNORED_KEYWORDS`; an `allOf` of several
schemas likewise): output that broke the schema would pass as valid.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import xgrammar as xgr

from kiln.engine.sampling_params import StructuredOutputParams

MAX_SCHEMA_DEPTH = 32
IGNORED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
# where a schema holds schemas: one, a list of them, or a name -> schema map (names are not keywords)
_ONE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
)
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class GrammarError(ValueError):
    """A constraint that cannot be compiled, or not in time; the message names the problem."""


def schema_problem(schema: Any, path: str = "#", depth: int = 0) -> str | None:
    """What in `schema` xgrammar would not enforce, or nests too deep, with where it is; None if nothing."""
    if not isinstance(schema, dict):
        return None
    if depth > MAX_SCHEMA_DEPTH:
        return f"it nests deeper than {MAX_SCHEMA_DEPTH} levels (at {path})"
    for keyword in IGNORED_KEYWORDS:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return f"'{keyword}' (at {path}) is not supported: output would not be held to it"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with several schemas (at {path}) is not supported: output would not be held to them all"
    children = [(f"{path}/{k}", schema[k]) for k in _ONE if isinstance(schema.get(k), dict)]
    children += [
        (f"{path}/{k}/{i}", s) for k in _LIST if isinstance(schema.get(k), list) for i, s in enumerate(schema[k])
    ]
    children += [(f"{path}/{k}/{n}", s) for k in _MAP if isinstance(schema.get(k), dict) for n, s in schema[k].items()]
    for where, child in children:
        if (problem := schema_problem(child, where, depth + 1)) is not None:
            return problem
    return None


WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "grammar": "EBNF grammar"}
# xgrammar's C++ errors read "[12:48:42] /project/cpp/regex_converter.cc:94: Check failed: (...) is false: msg".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_MESSAGE_CHARS = 300
_XGRAMMAR_ERRORS = (RuntimeError, ValueError, TypeError)  # what xgrammar raises on a constraint it cannot take


def check_grammar(params: StructuredOutputParams) -> None:
    """Parse a constraint without a tokenizer (no token masks are built) and raise `GrammarError` naming what is
    wrong. The API server runs it (in a worker process of its own, `kiln.engine.serving.grammar_checks`) before
    admitting a request, so a bad schema is a 400 at once, streaming or not."""
    if params.kind == "json":
        problem = schema_problem(json.loads(params.json))
        if problem is not None:
            raise GrammarError(f"invalid JSON schema: {problem}")
    with xgrammar_errors(params):
        xgrammar_grammar(params)


@contextlib.contextmanager
def xgrammar_errors(params: StructuredOutputParams):
    """What xgrammar raises on `params` (parsing it, or compiling it for a tokenizer), as a GrammarError naming the
    kind of constraint and the problem without xgrammar's source location."""
    try:
        yield
    except _XGRAMMAR_ERRORS as e:
        raise GrammarError(f"invalid {WHAT[params.kind]}: {_xgrammar_message(e)}") from None


def xgrammar_grammar(params: StructuredOutputParams) -> xgr.Grammar:
    # JSON is compact with fixed separators (", " and ": "): a model cannot pad it with whitespace forever.
    if params.kind == "json":
        schema = _string_lengths_as_patterns(json.loads(params.json))
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    if params.kind == "json_object":  # any object (strict mode would allow only the listed properties: none)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if params.kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    return xgr.Grammar.from_ebnf(params.grammar)


def _string_lengths_as_patterns(schema: Any) -> Any:
    """A copy of `schema` in which a string with minLength / maxLength (and no pattern or format) says the
    same as a pattern, ``^.{min,max}$``.

    NOTE: xgrammar 0.2.9 compiles a length-limited string to a character class that lets raw control
    characters (a tab, say) into it: invalid JSON. Its pattern path encodes the string properly (no raw
    control characters, no quote or backslash), so the limits are handed over that way.
    """
    if isinstance(schema, list):
        return [_string_lengths_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    # Values under these keys are data, not schemas.
    out = {
        k: v if k in ("enum", "const", "default", "examples") else _string_lengths_as_patterns(v)
        for k, v in schema.items()
    }
    lengths = [out.get("minLength"), out.get("maxLength")]
    if (
        out.get("type") == "string"
        and lengths != [None, None]
        and all(isinstance(n, int | None) for n in lengths)
        and not {"pattern", "format", "enum", "const"} & set(out)
    ):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^.{{{lengths[0] or 0},{'' if lengths[1] is None else lengths[1]}}}$"
    return out


def _xgrammar_message(error: Exception) -> str:
    message = _XGRAMMAR_PREFIX.sub("", str(error).strip())
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[:_MAX_MESSAGE_CHARS] + "..."

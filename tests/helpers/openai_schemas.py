"""Validators for Kiln's replies built from the schemas of OpenAI's OpenAPI document vendored in
tests/engine/serving/data/openai_schemas.json (scripts/dev/vendor_openai_schemas.py names their source and commit).

Stricter than the spec in one way: an object may hold only the properties the spec names for it (the spec leaves
extra ones open), so every field Kiln adds is one the caller allows by name (`extras`). The spec's own OpenAPI 3.0
leftovers are read as it means them: `nullable: true` admits null, `$recursiveRef: "#"` is the schema it sits in."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema

VENDORED = Path(__file__).resolve().parents[1] / "engine/serving/data/openai_schemas.json"
PREFIX = "#/components/schemas/"
# keywords whose value is one subschema, or a map of names to subschemas, evaluated at another place of the instance
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedItems")
_MAP = ("properties", "patternProperties")


def load() -> dict[str, Any]:
    return json.loads(VENDORED.read_text())


def _convert(node: Any, open_: bool, component: str) -> Any:
    """`node` with its `$ref`s pointing into `$defs` and, unless `open_`, extra properties refused: an object schema
    gets `unevaluatedProperties: false`. NOTE: a schema evaluated as one part of an object (an `allOf` member, or a
    variant of a schema that names properties of its own) stays open (`X.open` for a reference), since the
    properties of the other parts would be extra to it; the enclosing schema's `unevaluatedProperties` sees them all."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if node.pop("nullable", False):
        return {"anyOf": [_convert(node, open_, component), {"type": "null"}]}
    parts_open = open_ or "properties" in node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref":
            out["$ref"] = "#/$defs/" + value.removeprefix(PREFIX) + (".open" if parts_open else "")
        elif key == "$recursiveRef":
            out["$ref"] = "#/$defs/" + component + (".open" if parts_open else "")
        elif key == "$recursiveAnchor":
            continue
        elif key in _MAP:
            out[key] = {name: _convert(v, False, component) for name, v in value.items()}
        elif key in _ONE:
            out[key] = _convert(value, False, component)
        elif key == "prefixItems":
            out[key] = [_convert(v, False, component) for v in value]
        elif key == "allOf":
            out[key] = [_convert(v, True, component) for v in value]
        elif key in ("anyOf", "oneOf"):
            out[key] = [_convert(v, parts_open, component) for v in value]
        elif key == "not":
            out[key] = _convert(value, True, component)  # (an open schema under `not` refuses no less)
        else:
            out[key] = value
    if not open_ and ("properties" in node or "allOf" in node) and "additionalProperties" not in node:
        out["unevaluatedProperties"] = False
    return out


def validator(name: str, extras: dict[tuple[str, str], dict[str, Any]] | None = None) -> jsonschema.Validator:
    """A validator of component `name`. `extras`: (component, JSON pointer to an object schema inside it) -> the
    properties Kiln adds there, each with its schema."""
    schemas = copy.deepcopy(load()["schemas"])
    for (component, pointer), properties in (extras or {}).items():
        node = schemas[component]
        for part in filter(None, pointer.split("/")):
            node = node[int(part)] if isinstance(node, list) else node[part]
        node.setdefault("properties", {}).update(properties)
    defs = {}
    for component, schema in schemas.items():
        defs[component] = _convert(schema, False, component)
        defs[component + ".open"] = _convert(schema, True, component)
    root = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": defs, "$ref": f"#/$defs/{name}"}
    jsonschema.Draft202012Validator.check_schema(root)
    return jsonschema.Draft202012Validator(root)


def problems(check: jsonschema.Validator, instance: Any) -> list[str]:
    """What `check` finds wrong with `instance`, one line each, with its place. An object that matches no variant of
    a union is told by the variant its `type` names. NOTE: a part that fails takes its properties' evaluation with it,
    so an object around a failure deeper down reports all of them as unevaluated: such a report is left out."""
    errors = [_cause(error) for error in check.iter_errors(instance)]
    paths = [list(e.absolute_path) for e in errors]

    def cascade(error: jsonschema.ValidationError) -> bool:
        here = list(error.absolute_path)
        return error.validator == "unevaluatedProperties" and any(
            len(p) > len(here) and p[: len(here)] == here for p in paths
        )

    return [f"at /{'/'.join(str(p) for p in e.absolute_path)}: {e.message[:300]}" for e in errors if not cascade(e)]


def _cause(error: jsonschema.ValidationError) -> jsonschema.ValidationError:
    if not error.context:
        return error
    by_variant: dict[Any, list[jsonschema.ValidationError]] = {}
    for sub in error.context:
        by_variant.setdefault(sub.schema_path[0], []).append(sub)
    # the variants whose `type` property (the spec's discriminator) the instance matches
    named = [subs for subs in by_variant.values() if not any(list(s.relative_path) == ["type"] for s in subs)]
    if isinstance(error.instance, dict) and "type" in error.instance and len(named) == 1:
        return _cause(min(named[0], key=lambda s: s.validator == "unevaluatedProperties"))
    return jsonschema.exceptions.best_match([error])

"""Vendor the component schemas of OpenAI's OpenAPI document that Kiln's replies are validated against
(tests/engine/serving/test_openai_schema.py): the roots below and every schema they reference, written to
tests/engine/serving/data/openai_schemas.json with the spec's source, commit and version.

    python scripts/dev/vendor_openai_schemas.py PATH/TO/openai-openapi   # a git checkout of openai/openai-openapi

Each schema is kept as the spec writes it, less its annotations (description, title, examples, deprecated and the
x- extensions), which validate nothing; `$ref`s stay `#/components/schemas/NAME` (the test resolves them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SOURCE = "https://github.com/openai/openai-openapi"
SPEC_FILE = "openapi.json"
OUT = Path(__file__).resolve().parents[2] / "tests/engine/serving/data/openai_schemas.json"
ROOTS = [
    "CreateCompletionResponse",  # a completion, whole and each chunk of its stream
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "Response",
    "ErrorResponse",
    "ListModelsResponse",
]
STREAM_UNION = "ResponseStreamEvent"  # the Responses API's events; those Kiln sends are vendored, by their `type`
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.completed",
    "error",
]
ANNOTATIONS = {"description", "title", "example", "examples", "deprecated"}


def without_annotations(node: Any) -> Any:
    if isinstance(node, list):
        return [without_annotations(v) for v in node]
    if not isinstance(node, dict):
        return node
    kept = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs"):  # (a map of names: a property may be called "title")
            kept[key] = {name: without_annotations(v) for name, v in value.items()}
        elif key not in ANNOTATIONS and not key.startswith("x-"):
            kept[key] = without_annotations(value)
    return kept


def references(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value.rsplit("/", 1)[-1]
            else:
                yield from references(value)
    elif isinstance(node, list):
        for value in node:
            yield from references(value)


def event_schemas(schemas: dict[str, Any]) -> dict[str, str]:
    """Each event type Kiln sends -> the member of ResponseStreamEvent that describes it."""
    by_type = {}
    for member in schemas[STREAM_UNION]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[-1]
        for event_type in schemas[name]["properties"]["type"]["enum"]:
            by_type[event_type] = name
    missing = [t for t in EVENTS if t not in by_type]
    if missing:
        raise SystemExit(f"not in {STREAM_UNION}: {missing}")
    return {t: by_type[t] for t in EVENTS}


def main(checkout: Path) -> None:
    spec = json.loads((checkout / SPEC_FILE).read_text())
    commit = subprocess.run(
        ["git", "-C", str(checkout), "log", "-1", "--format=%H %cs", "--", SPEC_FILE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    schemas = spec["components"]["schemas"]
    events = event_schemas(schemas)
    needed, todo = set(), [*ROOTS, *events.values()]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo += references(schemas[name])
    head = {
        "source": SOURCE,
        "file": SPEC_FILE,
        "commit": commit[0],
        "commit_date": commit[1],
        "openapi": spec["openapi"],
        "version": spec["info"]["version"],
        "note": "components.schemas, as the spec writes them less description, title, examples, deprecated and x-*",
        "roots": ROOTS,
        "events": events,
    }
    lines = [f"  {json.dumps(name)}: {json.dumps(without_annotations(schemas[name]))}" for name in sorted(needed)]
    text = json.dumps(head, indent=1)[:-2] + ',\n "schemas": {\n' + ",\n".join(lines) + "\n }\n}\n"
    json.loads(text)  # (well formed)
    OUT.write_text(text)
    print(f"{len(needed)} schemas from {SOURCE} {SPEC_FILE} at {commit[0]} (version {head['version']}) -> {OUT}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

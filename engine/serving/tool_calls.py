"""Tool calling on the chat endpoint: what `tool_choice` makes of a request, and a choice's text as content and
OpenAI-shaped tool calls, streamed or whole.

    "none"      the tools are shown to the model (its chat template), its text is content
    "auto"      the model decides; `--tool-call-parser` reads its calls out of the text (needs
                `--enable-auto-tool-choice`, as in vLLM)
    "required"  the reply is constrained (structured output) to a JSON list of {"name", "parameters"} of the tools
                offered, each schema-valid: a valid call whatever the model
    {"type": "function", "function": {"name": F}}   the reply is constrained to F's arguments
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kiln.engine.sampling_params import StructuredOutputParams
from kiln.engine.serving.openai_requests import APIError, ParsedRequest
from kiln.engine.serving.tool_parsers import PARSERS, NamedParser, RequiredParser, Scan, ToolParser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def tool_parser(parsed: ParsedRequest, auto_parser: str | None) -> ToolParser | None:
    """The parser a chat request's replies go through (None: plain content), with the request's constraint set for
    "required" and a named choice. `auto_parser`: the server's --tool-call-parser when auto tool choice is on."""
    choice = parsed.tool_choice
    if choice == "none" or parsed.tools is None:
        return None
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
        parser = PARSERS[auto_parser]()
        parser.offer({t["function"]["name"]: t["function"] for t in parsed.tools})
        if parser.needs_special_tokens:
            parsed.params = dataclasses.replace(parsed.params, skip_special_tokens=False)
        return parser
    if parsed.params.structured_output is not None:
        raise APIError(
            400, f"tool_choice {choice!r} constrains the reply itself: give no response_format", "tool_choice"
        )
    functions = {t["function"]["name"]: t["function"] for t in parsed.tools}
    if choice == "required":
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(f) for f in functions.values()]},
        }
        if not parsed.parallel_tool_calls:
            schema["maxItems"] = 1
        parser: ToolParser = RequiredParser()
    else:
        schema = _parameters(functions[parsed.tool_function])
        parser = NamedParser(parsed.tool_function)
    parser.offer(functions)  # (the constraint holds the reply to them: this holds the parse too)
    parsed.params = dataclasses.replace(parsed.params, structured_output=_constraint(schema))
    parsed.constraint_param = "tools"
    return parser


def _constraint(schema: dict[str, Any]) -> StructuredOutputParams:
    """A tool schema as a constraint: one past the constraint size limit (or the like) is a 400 naming `tools`."""
    try:
        return StructuredOutputParams(json=schema)
    except ValueError as e:
        raise APIError(400, str(e).replace("structured_output.json", "a tool's parameters schema"), "tools") from None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "parameters": _parameters(function)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def tool_schema_checks(parsed: ParsedRequest) -> list[StructuredOutputParams]:
    """Each offered tool's parameters as a constraint to parse: a schema that is not one is a 400 naming `tools`."""
    if parsed.tools is None:
        return []
    schemas = [t["function"].get("parameters") for t in parsed.tools]
    return [_constraint(schema) for schema in schemas if schema is not None]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's text as content and tool calls: `update` with the whole text so far returns what to send now;
    `message` the reply's fields at the end."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.content_sent = 0
        self.sent: list[list[Any]] = []  # per call: [id, characters of its arguments sent]
        self.last = Scan("")
        self.scanned = 0  # the text's length at the last scan

    def _scan(self, text: str, final: bool) -> Scan:
        scan = self.parser.scan(text, final)
        if not self.parallel:
            scan.calls = scan.calls[:1]
        self.last = scan
        return scan

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool-call deltas: OpenAI's `delta.tool_calls` entries).

        NOTE: a scan reads the whole text, so a call streamed token by token would cost its length squared (8k
        tokens of arguments: 4.7 s of the API server's CPU). Once calls are being written, the text is scanned again
        only when it has grown by a 32nd since the last scan: the work stays linear, and the deltas of a long call
        come a few hundred characters at a time."""
        if not final and self.last.calls and len(text) - self.scanned < len(text) // 32:
            return "", []
        self.scanned = len(text)
        scan = self._scan(text, final)
        content = scan.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(scan.content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break
            if index == len(self.sent):
                self.sent.append([call_id(), 0])
                deltas.append(
                    {
                        "index": index,
                        "id": self.sent[index][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            new = call.arguments[self.sent[index][1] :]
            if new:
                self.sent[index][1] = len(call.arguments)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += new
                else:
                    deltas.append({"index": index, "function": {"arguments": new}})
        return content, deltas

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole reply's content (None when there is only whitespace besides the calls) and tool calls."""
        scan = self._scan(text, True)
        calls = []
        for index, call in enumerate(scan.calls):
            known = index < len(self.sent)
            calls.append(
                {
                    "id": self.sent[index][0] if known else call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
        content = scan.content if scan.content.strip() or not calls else None
        return content, calls

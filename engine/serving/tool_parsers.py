"""Tool calls read out of a model's text, in the formats models write them (vLLM's parser names); each parser reads
the whole text so far as `tool_scan.ToolParser` says.
"""

from __future__ import annotations

import ast
import json
import re

from kiln.engine.serving.partial_json import (
    WHITESPACE,
    Malformed,
    PartialCall,
    held_back,
    json_list_calls,
    object_call,
    raw_value,
    skip_ws,
    strict_json,
    value_end,
)
from kiln.engine.serving.qwen3_coder_parser import Qwen3CoderParser
from kiln.engine.serving.tool_scan import Scan, ToolParser


class MarkerParser(ToolParser):
    """Content, then calls each opened by a marker: hermes, mistral."""

    marker = ""

    def _content_before_markup(self, text: str) -> str:
        first = text.find(self.marker)
        return text[:first] if first >= 0 else text[: len(text) - held_back(text, self.marker)]

    def _scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.marker)
        if first < 0:
            return Scan(text if final else self._content_before_markup(text))
        calls = self._calls(text, first + len(self.marker), final)
        if final and (not calls or not all(c.done for c in calls)):
            raise Malformed("unfinished tool call")
        return Scan(text[:first], calls)

    def _calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        raise NotImplementedError


class HermesParser(MarkerParser):
    """Qwen2.5, Qwen3, Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call."""

    name = "hermes"
    marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        calls = []
        while True:
            i = skip_ws(text, i)
            if i >= len(text):
                return calls
            if text[i] != "{":
                raise Malformed("a JSON object after <tool_call>")
            call, end = object_call(text, i, final)
            calls.append(call)
            if end is None:
                return calls
            close = text.find(self.end_marker, end)
            if close < 0:  # not closed yet (or never: a reply may stop right after the object)
                rest = text[end:].strip(WHITESPACE)
                if rest and not self.end_marker.startswith(rest):
                    raise Malformed("text after a call")
                return calls
            if text[end:close].strip(WHITESPACE):
                raise Malformed("text between a call and </tool_call>")
            following = text.find(self.marker, close)
            if following < 0:
                return calls
            i = following + len(self.marker)


class MistralParser(MarkerParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or (newer tokenizers) one
    `[TOOL_CALLS]name[ARGS]{...}` a call."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def _calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        i = skip_ws(text, i)
        if i >= len(text):
            return []
        if text[i] == "[":
            return json_list_calls(text, i, final, ("arguments", "parameters"))
        calls = []
        while True:
            args_at = text.find("[ARGS]", i)
            if args_at < 0:
                return calls
            name = text[i:args_at].strip()
            if not re.fullmatch(r"[\w.\-]+", name):
                raise Malformed("a tool name")
            start = skip_ws(text, args_at + len("[ARGS]"))
            end = value_end(text, start, final)
            call = PartialCall(name, raw_value(text, start, end))
            calls.append(call)
            if end is None:
                return calls
            call.done = True
            if not isinstance(strict_json(call.arguments), dict):
                raise Malformed("arguments that are not an object")
            following = skip_ws(text, end)
            if not text.startswith(self.marker, following):
                if text[following:] and not self.marker.startswith(text[following:]):
                    raise Malformed("text after a call")
                return calls
            i = following + len(self.marker)


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3: the reply is `{"name": ..., "parameters": {...}}` (calls joined by `;`), maybe after
    `<|python_tag|>`; a reply that starts otherwise is content."""

    name = "llama3_json"
    tag = "<|python_tag|>"
    needs_special_tokens = True

    def _scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not rest or (not final and self.tag.startswith(rest)):
            return Scan("" if not final else text)
        if rest.startswith(self.tag):
            i = skip_ws(text, i + len(self.tag))
            if i >= len(text):
                if final:
                    raise Malformed("a tag without a call")
                return Scan("")
        elif rest[0] != "{":
            return Scan(text)
        calls = []
        while True:
            call, end = object_call(text, i, final)
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
                if i < len(text) and text[i] == "{":
                    continue
            if i < len(text) and final:
                raise Malformed("text after the calls")
            break
        if final and not all(c.done for c in calls):
            raise Malformed("unfinished tool call")
        return Scan("", calls)


class PythonicParser(ToolParser):
    """Llama 4 and others: the reply is a Python list of calls, `[get_weather(city="Paris"), now()]` (maybe inside
    `<|python_start|>`...`<|python_end|>`); keyword arguments of literal values, sent as JSON."""

    name = "pythonic"
    start_tag, end_tag = "<|python_start|>", "<|python_end|>"

    def _scan(self, text: str, final: bool) -> Scan:
        body = text.strip(WHITESPACE)
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag) :].removesuffix(self.end_tag).strip(WHITESPACE)
        elif not final and body and self.start_tag.startswith(body):
            return Scan("")
        if not body:
            return Scan(text if final else "")
        if body[0] != "[":
            return Scan(text)
        if final:
            return Scan("", [self._call(node) for node in self._list(body)])
        return Scan("", self._partial(body))

    @staticmethod
    def _list(body: str) -> list[ast.Call]:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts or not all(isinstance(e, ast.Call) for e in tree.elts):
            raise Malformed("a list of calls")
        return tree.elts

    @staticmethod
    def _call(node: ast.Call) -> PartialCall:
        if not isinstance(node.func, ast.Name) or node.args:
            raise Malformed("a call by name with keyword arguments")
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        # (a set or bytes is a TypeError, an infinity a ValueError: JSON has neither)
        return PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False), True)

    def _partial(self, body: str) -> list[PartialCall]:
        """The calls finished so far. NOTE: a call is begun only once it is whole: its Python literals become JSON only
        then, and one that JSON cannot carry (a set, bytes, an infinity) must not have been sent."""
        calls, depth, quote, start, j = [], 0, None, 1, 1
        while j < len(body):
            ch = body[j]
            if quote is not None:
                if ch == "\\":
                    j += 1
                elif ch == quote:
                    quote = None
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:  # the list's own ']'
                    break
                depth -= 1
                if depth == 0 and ch == ")":
                    node = ast.parse(body[start : j + 1].strip(" ,\t\r\n"), mode="eval").body
                    if not isinstance(node, ast.Call):
                        raise Malformed("a call")
                    calls.append(self._call(node))
                    start = j + 1
            j += 1
        return calls


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, Qwen3CoderParser)
}


class RequiredParser(ToolParser):
    """`tool_choice: "required"`: the reply is constrained to a JSON list of {"name": ..., "parameters": {...}}."""

    name = "required"

    def _scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise Malformed("no calls")
            return Scan("")
        if text[i] != "[":
            raise Malformed("a list of calls")
        return Scan("", json_list_calls(text, i, final, ("parameters", "arguments")))


class NamedParser(ToolParser):
    """A named `tool_choice`: the reply is constrained to the function's arguments, a JSON object."""

    def __init__(self, function: str) -> None:
        self.function = function

    def _scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        end = value_end(text, i, final) if i < len(text) else None
        call = PartialCall(self.function, raw_value(text, i, end))
        if final:
            if end is None or not isinstance(strict_json(call.arguments), dict):
                raise Malformed("arguments that are not an object")
            call.done = True
        return Scan("", [call])

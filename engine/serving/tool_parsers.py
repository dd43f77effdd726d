"""Tool calls read out of a model's text, in the formats models write them (vLLM's parser names); each parser reads
the whole text so far as `tool_scan.ToolParser` says.
"""

from __future__ import annotations

import ast
import json
import re

from kiln.engine.serving.gemma4_tool_parser import Gemma4ToolParser
from kiln.engine.serving.harmony import HarmonyToolParser
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
from kiln.engine.serving.tool_scan import PARSE_ERRORS, Scan, ToolParser, longest_reading


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
        if final and not calls:
            raise Malformed("a marker without a call")
        return Scan(text[:first], calls)

    def _calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        raise NotImplementedError


class HermesParser(MarkerParser):
    """Qwen2.5, Qwen3, Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block a call. A
    block whose JSON breaks keeps its call as far as it went (none, before its name), and the blocks after it count."""

    name = "hermes"
    marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        calls = []
        while True:
            close = text.find(self.end_marker, i)
            call = self._block_call(text[i : close if close >= 0 else len(text)], final or close >= 0)
            if call is not None:
                calls.append(call)
            following = text.find(self.marker, close) if close >= 0 else -1
            if following < 0:  # (text after the last block is passed over)
                return calls
            i = following + len(self.marker)

    def _block_call(self, block: str, whole: bool) -> PartialCall | None:
        try:
            return self._read_block(block, whole)
        except PARSE_ERRORS:
            call = longest_reading(lambda prefix: self._read_block(prefix, False), block)
            return call if call is not None and call.name is not None else None

    def _read_block(self, block: str, whole: bool) -> PartialCall | None:
        """The call in one block's text (`whole`: the block has ended); None while it is only whitespace."""
        i = skip_ws(block, 0)
        if i >= len(block):
            if whole:
                raise Malformed("an empty <tool_call>")
            return None
        if block[i] != "{":
            raise Malformed("a JSON object after <tool_call>")
        call, end = object_call(block, i, whole)
        if call.name is not None and self.offered is not None and call.name not in self.offered:
            raise Malformed("a call to a tool that was not offered")
        rest = block[end:].strip(WHITESPACE) if end is not None else ""
        if rest and (whole or not self.end_marker.startswith(rest)):
            raise Malformed("text after a call")
        return call


# where a Mistral call's name ends: at [ARGS], or at its arguments' brace (a reader skipping special tokens drops it)
ARGUMENTS_START = re.compile(r"\[ARGS\]|(?=\{)")


class MistralParser(MarkerParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11), or one
    `[TOOL_CALLS]name[ARGS]{...}` a call (v11 on; `[TOOL_CALLS]name{...}` once [ARGS] is dropped)."""

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
            name_end = ARGUMENTS_START.search(text, i)
            if name_end is None:
                return calls
            name = text[i : name_end.start()].strip()
            if not re.fullmatch(r"[\w.\-]+", name):
                raise Malformed("a tool name")
            start = skip_ws(text, name_end.end())
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
    """Llama 3.1-3.3: calls as JSON objects `{"name": ..., "parameters": {...}}`, each after `<|python_tag|>` or not,
    joined by `;` or a newline. Prose before the first call is content (a `{` opens one only if a call's object
    follows it), prose after the last is passed over."""

    name = "llama3_json"
    tag = "<|python_tag|>"
    needs_special_tokens = True

    def _start(self, text: str, final: bool) -> int:
        """Where the calls begin: the first tag, or the first `{` before it that opens a call (or may yet); -1 if
        none does."""
        tag = text.find(self.tag)
        limit = tag if tag >= 0 else len(text)
        brace = text.find("{", 0, limit)
        while brace >= 0:
            try:
                object_call(text, brace, final)
                return brace
            except PARSE_ERRORS:  # (prose: a brace of text, an object that is no call)
                brace = text.find("{", brace + 1, limit)
        return tag

    def _content_before_markup(self, text: str) -> str:
        start = self._start(text, False)
        return text[:start] if start >= 0 else text[: len(text) - held_back(text, self.tag)]

    def _scan(self, text: str, final: bool) -> Scan:
        start = self._start(text, final)
        if start < 0:
            return Scan(text if final else self._content_before_markup(text))
        calls, i = [], start
        while True:
            if text.startswith(self.tag, i):
                i = skip_ws(text, i + len(self.tag))
            if i >= len(text) or text[i] != "{":
                if not calls and (final or i < len(text)):
                    raise Malformed("a tag without a call")
                break
            call, end = object_call(text, i, final)
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if text.startswith(";", i):
                i = skip_ws(text, i + 1)
            if not (text.startswith("{", i) or text.startswith(self.tag, i)):
                break  # (prose after the calls, or a tag still coming)
        return Scan(text[:start], calls)


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
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        PythonicParser,
        Qwen3CoderParser,
        Gemma4ToolParser,
        HarmonyToolParser,
    )
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

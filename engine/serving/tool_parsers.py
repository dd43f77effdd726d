"""Tool calls read out of a model's text, in the formats models write them (vLLM's parser names).

A parser's `scan(text, final)` reads the whole text so far and says what of it is plain content and which calls it
holds, each call's name once its name is complete and the raw JSON text of its arguments as far as it goes. Made
for streaming: as the text grows, the content and each call's arguments only grow (what was said stays said), so
the stream sends the differences (`tool_calls.ToolCallStream`) and ends with what a non-streamed reply holds. Text
that could still turn into markup (a partial `<tool_call>`) is held back until it is clear. A reply whose markup
does not parse at the end is content, whole.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"


@dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str = ""  # the raw JSON text of the arguments so far ("{}" when a finished call gives none)
    done: bool = False


@dataclass
class Scan:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class Malformed(ValueError):
    """Markup that cannot be a tool call."""


# ---- JSON read piece by piece ----------------------------------------------------------------------------


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int, final: bool) -> int | None:
    """Where the JSON value starting at `i` ends (one past it), or None while it is still incomplete."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < n:
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if c in "{[":
        depth, in_string, j = 0, False, i
        while j < n:
            ch = text[j]
            if in_string:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal ends where a delimiter starts
    while j < n and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < n or final else None


def scan_object(text: str, i: int, final: bool) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object starting at `i` ('{'), as key -> (value start, value end or None), and where
    the object ends (None while incomplete). Raises Malformed on text that cannot be an object."""
    fields: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(text, i + 1)
    while True:
        if j >= len(text):
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] != '"':
            raise Malformed("an object key")
        key_end = value_end(text, j, final)
        if key_end is None:
            return fields, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return fields, None
        if text[j] != ":":
            raise Malformed("a colon")
        start = skip_ws(text, j + 1)
        end = value_end(text, start, final)
        fields[key] = (start, end)
        if end is None:
            return fields, None
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "}":
            raise Malformed("a comma")


def object_call(text: str, i: int, final: bool, keys: tuple[str, ...] = ("arguments", "parameters")):
    """The call in a JSON object {"name": ..., "arguments": {...}} starting at `i`, and where the object ends."""
    fields, end = scan_object(text, i, final)
    call = PartialCall(None)
    start, name_end = fields.get("name", (0, None))
    if name_end is not None:
        name = json.loads(text[start:name_end])
        if not isinstance(name, str):
            raise Malformed("a name")
        call.name = name
    key = next((k for k in keys if k in fields), None)
    if key is not None:
        start, args_end = fields[key]
        if text.startswith('"', start):  # arguments given as a JSON string: whole or not at all
            if args_end is not None:
                call.arguments = json.loads(text[start:args_end])
        else:
            call.arguments = text[start:args_end] if args_end is not None else text[start:].rstrip(WHITESPACE)
    if end is not None:
        if call.name is None:
            raise Malformed("a call without a name")
        call.arguments, call.done = call.arguments or "{}", True
        if not isinstance(json.loads(call.arguments), dict):
            raise Malformed("arguments that are not an object")
    return call, end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (and must wait)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# ---- the formats ------------------------------------------------------------------------------------------


class ToolParser:
    name = ""
    # the markup holds special tokens, which a detokenizer skipping them would drop
    needs_special_tokens = False

    def scan(self, text: str, final: bool) -> Scan:
        try:
            return self._scan(text, final)
        except (Malformed, ValueError, RecursionError, SyntaxError):
            if final:
                return Scan(text)
            return Scan(self._content_before_markup(text))

    def _scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def _content_before_markup(self, text: str) -> str:
        return ""


class MarkerParser(ToolParser):
    """Content, then calls each opened by a marker: hermes, mistral."""

    marker = ""

    def _content_before_markup(self, text: str) -> str:
        first = text.find(self.marker)
        return text[:first] if first >= 0 else text[: len(text) - held_back(text, self.marker)]

    def _scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.marker)
        if first < 0:
            return Scan(text if final else text[: len(text) - held_back(text, self.marker)])
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
            call = PartialCall(name, text[start:end] if end is not None else text[start:].rstrip(WHITESPACE))
            calls.append(call)
            if end is None:
                return calls
            call.done = True
            if not isinstance(json.loads(call.arguments), dict):
                raise Malformed("arguments that are not an object")
            following = skip_ws(text, end)
            if not text.startswith(self.marker, following):
                if text[following:] and not self.marker.startswith(text[following:]):
                    raise Malformed("text after a call")
                return calls
            i = following + len(self.marker)


def json_list_calls(text: str, i: int, final: bool, keys: tuple[str, ...]) -> list[PartialCall]:
    """The calls of a JSON list of call objects starting at `i` ('[')."""
    calls = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]":
            if final and not calls:
                raise Malformed("no calls")
            return calls
        if text[j] != "{":
            raise Malformed("a call object")
        call, end = object_call(text, j, final, keys)
        calls.append(call)
        if end is None:
            return calls
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "]":
            raise Malformed("a comma between calls")
    if final:
        raise Malformed("an unclosed list")
    return calls


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
        return PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False), True)

    def _partial(self, body: str) -> list[PartialCall]:
        """The calls so far: each finished one whole, the one being written by its name."""
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
        pending = re.match(r"[\s,]*([A-Za-z_]\w*)\s*\(", body[start:])
        if pending:
            calls.append(PartialCall(pending.group(1)))
        return calls


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
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
        call = PartialCall(self.function, text[i:end] if end is not None else text[i:].rstrip(WHITESPACE))
        if final:
            if end is None or not isinstance(json.loads(call.arguments), dict):
                raise Malformed("arguments that are not an object")
            call.done = True
        return Scan("", [call])

"""The `gemma4` tool-call format (Gemma 4's chat template): each call between special tokens, its arguments in the
template's own notation rather than JSON::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{metric:true},tags:[<|"|>a<|"|>]}<tool_call|>

Keys are bare, strings are delimited by the `<|"|>` token, numbers and booleans are bare, objects and lists nest.
Read into JSON as it streams: a string's characters as they come, a bare value once it has ended (a `tru` is not yet
a value), a key once its `:` is there.
"""

from __future__ import annotations

import json
import re

from kiln.engine.serving.partial_json import WHITESPACE, Malformed, PartialCall, held_back, skip_ws
from kiln.engine.serving.tool_scan import Scan, ToolParser

CALL_START, CALL_END, STRING = "<|tool_call>", "<tool_call|>", '<|"|>'
_NAME = re.compile(r"[\w\-.]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_BARE = {"true": "true", "false": "false", "null": "null"}

# (the JSON text of a value so far, where the text goes on after it, whether it is whole)
Reading = tuple[str, int, bool]


class Gemma4ToolParser(ToolParser):
    """Gemma 4: content, then one call or more, each `<|tool_call>call:NAME{ARGUMENTS}<tool_call|>`; what comes
    between and after the calls is passed over, as vLLM does."""

    name = "gemma4"
    needs_special_tokens = True

    def _content_before_markup(self, text: str) -> str:
        first = text.find(CALL_START)
        return text[:first] if first >= 0 else text[: len(text) - held_back(text, CALL_START)]

    def _scan(self, text: str, final: bool) -> Scan:
        first = text.find(CALL_START)
        if first < 0:
            return Scan(text if final else self._content_before_markup(text))
        calls, i = [], first
        while i >= 0:
            call, i = self._call(text, i + len(CALL_START), final)
            calls.append(call)
            if i is None:
                break
            i = text.find(CALL_START, i)
        return Scan(text[:first], calls)

    def _call(self, text: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
        """The call after a `<|tool_call>` at `i`, and where the text goes on after its end (None while it goes on)."""
        head = text[i : i + len("call:")]
        if not "call:".startswith(head) or (final and head != "call:"):
            raise Malformed("call:NAME after <|tool_call>")
        if head != "call:":
            return PartialCall(None), None
        start = i + len("call:")
        name_end = _NAME.match(text, start).end()
        if name_end == len(text) and not final:
            return PartialCall(None), None  # (the name may go on)
        if not text.startswith("{", name_end) or name_end == start:
            raise Malformed("call:NAME{")
        arguments, j, whole = _object(text, name_end, final)
        call = PartialCall(text[start:name_end], arguments)
        if not whole:
            return call, None
        j = skip_ws(text, j)
        if text.startswith(CALL_END, j):
            call.done = True
            return call, j + len(CALL_END)
        if final or not CALL_END.startswith(text[j : j + len(CALL_END)]):
            raise Malformed("<tool_call|> after a call's arguments")
        return call, None


def _value(text: str, i: int, final: bool) -> Reading:
    """The value at `i` (no whitespace before it)."""
    if text.startswith(STRING, i):
        end = text.find(STRING, i + len(STRING))
        if end >= 0:
            return json.dumps(text[i + len(STRING) : end], ensure_ascii=False), end + len(STRING), True
        if final:
            raise Malformed("an unterminated string")
        body = text[i + len(STRING) :]
        body = body[: len(body) - held_back(body, STRING)]  # (a partial closing token waits)
        return json.dumps(body, ensure_ascii=False)[:-1], len(text), False
    if text.startswith("{", i):
        return _object(text, i, final)
    if text.startswith("[", i):
        return _list(text, i, final)
    if not final and STRING.startswith(text[i:]):
        return "", len(text), False  # (a string's token, still coming)
    j = i
    while j < len(text) and text[j] not in ",}]":
        j += 1
    if j == len(text):  # (a bare value ends only where its container goes on)
        if final:
            raise Malformed("a value without its end")
        return "", j, False
    bare = text[i:j].strip()
    if bare in _BARE or _NUMBER.fullmatch(bare):
        return _BARE.get(bare, bare), j, True
    if not bare or any(c in bare for c in '{[:<"'):
        raise Malformed("a bare value")
    return json.dumps(bare, ensure_ascii=False), j, True  # (an unquoted word: a string, as vLLM reads it)


def _object(text: str, i: int, final: bool) -> Reading:
    """The object whose `{` is at `i`: its members `key:value` apart by commas, each key sent once its `:` has come."""
    return _container(text, i, final, "}", _member, "member")


def _list(text: str, i: int, final: bool) -> Reading:
    """The list whose `[` is at `i`."""
    return _container(text, i, final, "]", _value, "item")


def _member(text: str, j: int, final: bool) -> tuple[str | None, int, bool]:
    """An object's `key:value` at `j`, as JSON so far (None: its key may go on)."""
    colon = text.find(":", j)
    key = text[j:] if colon < 0 else text[j:colon]
    if any(c in key for c in "{}[],<>\"'") or (colon >= 0 and not key.strip()):
        raise Malformed("a key")
    if colon < 0:
        return None, j, False
    head = json.dumps(key.strip(" " + WHITESPACE), ensure_ascii=False) + ":"
    j = skip_ws(text, colon + 1)
    if j >= len(text):
        if final:
            raise Malformed("an unclosed object")
        return head, j, False
    value, j, whole = _value(text, j, final)
    return head + value, j, whole


def _container(text: str, i: int, final: bool, close: str, read, what: str) -> Reading:
    """An object's or a list's entries from its opening at `i` to `close`, apart by commas, each read by `read`
    (text, j, final) -> (its JSON so far, or None when nothing of it can be sent yet; where it ends; whole)."""
    out, j, first = text[i], i + 1, True
    while True:
        j = skip_ws(text, j)
        if j < len(text) and text[j] == close:
            return out + close, j + 1, True
        if not first:
            if j < len(text) and text[j] != ",":
                raise Malformed(f"a comma between {what}s")
            j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        entry, j, whole = read(text, j, final)
        if entry is None:
            break
        if entry or whole:
            out += ("" if first else ",") + entry
            first = False
        if not whole:
            return out, j, False
    if final:
        raise Malformed("an unclosed object" if close == "}" else "an unclosed list")
    return out, len(text), False

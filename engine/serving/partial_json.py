"""JSON read as it streams in: where a value ends (or that it has not yet), an object's members so far, and a tool
call's name and raw argument text from a call object written partway. The tool parsers (`tool_parsers`) build on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"


@dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str = ""  # the raw JSON text of the arguments so far ("{}" when a finished call gives none)
    done: bool = False


class Malformed(ValueError):
    """Markup that cannot be a tool call."""


def _not_json(name: str) -> None:
    raise Malformed(f"{name} is not JSON")


def strict_json(text: str):
    """`json.loads` without Python's NaN and Infinity, which no other JSON reader takes."""
    return json.loads(text, parse_constant=_not_json)


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


def raw_value(text: str, start: int, end: int | None) -> str:
    """A value's text: whole when it has ended, else as far as it goes (trailing whitespace may yet be inside it)."""
    return text[start:end] if end is not None else text[start:].rstrip(WHITESPACE)


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
        name = strict_json(text[start:name_end])
        if not isinstance(name, str):
            raise Malformed("a name")
        call.name = name
    key = next((k for k in keys if k in fields), None)
    as_string = False
    if key is not None:
        start, args_end = fields[key]
        as_string = text.startswith('"', start)
        if as_string:  # arguments given as a JSON string: whole or not at all
            if args_end is not None:
                call.arguments = _string_arguments(strict_json(text[start:args_end]))
        else:
            call.arguments = raw_value(text, start, args_end)
    if end is not None:
        if call.name is None:
            raise Malformed("a call without a name")
        call.arguments, call.done = call.arguments or "{}", True
        if not as_string and not isinstance(strict_json(call.arguments), dict):
            raise Malformed("arguments that are not an object")
    return call, end


def _string_arguments(value: str) -> str:
    """Arguments a model wrote as a JSON string (Granite 4 does): the object that string holds, or else the string
    itself as JSON, as vLLM reads them (the arguments are JSON either way)."""
    try:
        if isinstance(strict_json(value), dict):
            return value
    except ValueError:
        pass
    return json.dumps(value, ensure_ascii=False)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (and must wait)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


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

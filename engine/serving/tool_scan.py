"""The contract of a tool-call parser (`tool_parsers` holds the formats): `scan(text, final)` reads the whole text so
far and says what of it is plain content and which calls it holds, each call's name once its name is complete and the
raw JSON text of its arguments as far as it goes. Made for streaming: as the text grows, the content and each call's
arguments only grow (what was said stays said), so the stream sends the differences (`tool_calls.ToolCallStream`)
and ends with what a non-streamed reply holds. Text that could still turn into markup (a partial `<tool_call>`) is
held back until it is clear. A reply whose markup breaks before any call's name is complete is content, whole; one
whose markup breaks or stops later keeps the calls begun by then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kiln.engine.serving.partial_json import Malformed, PartialCall


@dataclass
class Scan:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


T = TypeVar("T")

# what reading the model's text may raise: markup this parser cannot take (a Python set or bytes as an argument, a
# nesting past the recursion limit)
PARSE_ERRORS = (Malformed, ValueError, TypeError, RecursionError, SyntaxError, MemoryError)


class ToolParser:
    name = ""
    # the markup holds special tokens, which a detokenizer skipping them would drop
    needs_special_tokens = False
    offered: frozenset[str] | None = None  # the request's tools' names: a call to any other is not a call
    schemas: dict[str, Any] | None = None  # their parameters' JSON schemas, by name (qwen3_coder types values by them)

    def offer(self, functions: dict[str, dict[str, Any]]) -> None:
        """The request's tools, as name -> OpenAI's function object."""
        self.offered = frozenset(functions)
        self.schemas = {name: function.get("parameters") for name, function in functions.items()}

    def scan(self, text: str, final: bool) -> Scan:
        """What of `text` is content and which calls it holds. NOTE: the text is the model's, so anything at all:
        markup this parser cannot take (a Python set as an argument, a name no tool has) is content, never an error
        of the request. And a stream sends a call as soon as its name is complete, so the final reading never takes
        back a call a stream of the same text has begun: markup that breaks or stops partway keeps its calls as far
        as they had gone (`_cut_short`)."""
        scan = self._checked(text, final)
        if not final:
            return scan if scan is not None else Scan(self._content_before_markup(text))
        if scan is None:
            return self._cut_short(text)
        return scan if all(call.name is not None for call in scan.calls) else self._begun(text, scan)

    def _checked(self, text: str, final: bool) -> Scan | None:
        """`_scan`'s reading, or None for markup that cannot be calls."""
        try:
            scan = self._scan(text, final)
        except PARSE_ERRORS:
            return None
        if self.offered is not None and any(c.name is not None and c.name not in self.offered for c in scan.calls):
            return None
        return scan

    def _cut_short(self, text: str) -> Scan:
        """A whole reply whose markup broke partway: the calls of the longest prefix that still reads as calls (each
        with its arguments as written by then), and nothing after."""
        scan = longest_reading(lambda prefix: self._checked(prefix, False), text)
        return self._begun(text, scan or Scan(""))

    @staticmethod
    def _begun(text: str, scan: Scan) -> Scan:
        """The calls whose names came (a stream has sent them); with none, the reply is content, whole."""
        calls = [call for call in scan.calls if call.name is not None]
        return Scan(scan.content, calls) if calls else Scan(text)

    def _scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def _content_before_markup(self, text: str) -> str:
        return ""


def longest_reading(read: Callable[[str], T | None], text: str) -> T | None:
    """`read` of the longest prefix of `text` it takes (None: it takes none; `read` returns None or raises for one it
    does not). NOTE: markup that cannot be calls stays so as the text grows, so the prefixes read are those below a
    bound, found by bisection in a few dozen reads."""

    def attempt(prefix: str) -> T | None:
        try:
            return read(prefix)
        except PARSE_ERRORS:
            return None

    found = attempt(text)
    if found is not None:
        return found
    good, bad = -1, len(text)
    while bad - good > 1:
        middle = (good + bad) // 2
        reading = attempt(text[:middle])
        if reading is None:
            bad = middle
        else:
            found, good = reading, middle
    return found

"""The `qwen3_coder` tool-call format (Qwen3-Coder, Qwen3.5, Qwen3.6): XML-like tags whose parameter values are raw
text, typed by the offered tool's schema (`schema_values`)."""

from __future__ import annotations

import json

from kiln.engine.serving.partial_json import Malformed, PartialCall, held_back, skip_ws
from kiln.engine.serving.schema_values import schema_value
from kiln.engine.serving.tool_scan import Scan, ToolParser


class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder, Qwen3.5, Qwen3.6: calls in XML-like tags, each parameter's value raw text, read as the JSON type
    the tool's schema gives it (`schema_values`); content before the first call; several calls one after another::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A call streams a parameter at a time (its type is known only once its value has ended). As vLLM reads them: a
    value loses one newline at each end; `<function=` without `<tool_call>` opens a call too; a parameter whose close
    tag is missing ends where the next of the tool's parameters opens (or, at the end, where the function does); a
    `</parameter>` is the value's end only when the next tag, the function's end or the reply's end follows it, so
    code that writes these tags inside a value stays in the value."""

    name = "qwen3_coder"
    openers = ("<tool_call>", "<function=")
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
    FUNCTION_END, CALL_END = "</function>", "</tool_call>"
    FOLLOWERS = (PARAMETER, FUNCTION_END, CALL_END)  # the tags that may come after a parameter

    def _first_opener(self, text: str, start: int = 0) -> int:
        found = [i for i in (text.find(opener, start) for opener in self.openers) if i >= 0]
        return min(found) if found else -1

    def _content_before_markup(self, text: str) -> str:
        first = self._first_opener(text)
        if first >= 0:
            return text[:first]
        return text[: len(text) - max(held_back(text, opener) for opener in self.openers)]

    def _scan(self, text: str, final: bool) -> Scan:
        first = self._first_opener(text)
        if first < 0:
            return Scan(text if final else self._content_before_markup(text))
        calls, i = [], first
        while i >= 0:
            if text.startswith("<tool_call>", i):
                i = skip_ws(text, i + len("<tool_call>"))
            if i >= len(text) or (not final and "<function=".startswith(text[i:])):
                break  # the function's tag is still to come
            if not text.startswith("<function=", i):
                raise Malformed("<function=NAME> after <tool_call>")
            start = i + len("<function=")
            try:
                name_end = _tag_end(text, start, final)
            except Malformed:  # a name that is no name (none of it was sent): passed over, as vLLM does
                i = self._first_opener(text, start)
                continue
            if name_end is None:
                calls.append(PartialCall(None))
                break
            call, i = self._call(text, start, name_end, final)
            calls.append(call)
            if i is None:
                break
            i = self._first_opener(text, i)  # (what comes between calls is passed over, as after the last)
        if final and not calls:
            raise Malformed("an opening tag without a call")
        return Scan(text[:first], calls)

    def _call(self, text: str, i: int, name_end: int, final: bool) -> tuple[PartialCall, int | None]:
        """The call whose name lies in text[i:name_end], and where the text after its end goes on (None while it goes
        on)."""
        call = PartialCall(text[i:name_end])
        schema = (self.schemas or {}).get(call.name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        members: list[str] = []  # each parameter given so far, as JSON's "name": value
        given: set[str] = set()
        j = name_end + 1
        while True:
            call.arguments = "{" + ", ".join(members)
            j = skip_ws(text, j)
            if text.startswith(self.FUNCTION_END, j) or text.startswith(self.CALL_END, j):
                call.arguments, call.done = call.arguments + "}", True
                return call, j + len(self.FUNCTION_END) if text.startswith(self.FUNCTION_END, j) else j
            if not text.startswith(self.PARAMETER, j):
                rest = text[j : j + len(self.PARAMETER)]
                if j >= len(text) or (not final and any(tag.startswith(rest) for tag in self.FOLLOWERS)):
                    return call, None  # (stopped here: the call so far)
                raise Malformed("text between a function's parameters")
            start = j + len(self.PARAMETER)
            parameter_end = _tag_end(text, start, final)
            if parameter_end is None:
                return call, None
            parameter = text[start:parameter_end]
            value_start = parameter_end + 1 + text.startswith("\n", parameter_end + 1)
            found = self._value_end(text, value_start, set(properties) - given - {parameter}, final)
            if found is None:
                return call, None
            value_end, j = found
            value = text[value_start:value_end]
            value = value[:-1] if value.endswith("\n") else value
            typed = schema_value(value, properties.get(parameter))
            members.append(f"{json.dumps(parameter, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}")
            given.add(parameter)

    def _value_end(self, text: str, start: int, unseen: set[str], final: bool) -> tuple[int, int] | None:
        """Where the value starting at `start` ends and the text after it goes on, or None while that is unknown.

        A `</parameter>` ends the value when a tag, the function's end or the reply's end follows it; a nested
        `<parameter=X>` on a line of its own (code writing these tags) pairs with the next `</parameter>`, unless X is
        one of the tool's parameters not given yet: then the close tag was left out and the value ends there."""
        depth, j = 0, start
        while True:
            close = text.find(self.PARAMETER_END, j)
            opening = text.find("\n" + self.PARAMETER, max(j - 1, 0)) + 1
            if opening > 0 and (close < 0 or opening < close):
                try:
                    name_end = _tag_end(text, opening + len(self.PARAMETER), final)
                except Malformed:  # (no tag after all: text of the value)
                    j = opening + 1
                    continue
                if name_end is None:
                    return None
                if depth == 0 and text[opening + len(self.PARAMETER) : name_end] in unseen:
                    return opening, opening
                depth, j = depth + 1, name_end
                continue
            if close < 0:
                break
            j = close + len(self.PARAMETER_END)
            if depth > 0:
                depth -= 1
                continue
            after = skip_ws(text, j)
            if any(text.startswith(tag, after) for tag in self.FOLLOWERS) or (final and after == len(text)):
                return close, j
            if not final and any(tag.startswith(text[after : after + len(tag)]) for tag in self.FOLLOWERS):
                return None  # (what follows the close tag decides)
        if not final:
            return None
        # the reply ended inside the value, or its close tag is missing: it ends where a parameter or the function does
        ends = [text.find("\n" + self.PARAMETER, start - 1) + 1]
        ends += [text.find(tag, start) for tag in (self.FUNCTION_END, self.CALL_END)]
        end = min([end for end in ends if end > 0] or [len(text)])
        return end, end


def _tag_end(text: str, i: int, final: bool) -> int | None:
    """Where the name in a tag (`<function=NAME>`, `<parameter=NAME>`) starting at `i` ends (its `>`), or None while it
    is incomplete. A name is one line without quotes, braces or angle brackets."""
    end = text.find(">", i)
    name = text[i:] if end < 0 else text[i:end]
    if any(c in name for c in "\n\r<{}\"'") or (end >= 0 and not name.strip()):
        raise Malformed("a tag's name")
    if end < 0 and final:
        raise Malformed("an unclosed tag")
    return end if end >= 0 else None


def _tag_end(text: str, i: int, final: bool) -> int | None:
    """Where the name in a tag (`<function=NAME>`, `<parameter=NAME>`) starting at `i` ends (its `>`), or None while it
    is incomplete. A name is one line without quotes, braces or angle brackets."""
    end = text.find(">", i)
    name = text[i:] if end < 0 else text[i:end]
    if any(c in name for c in "\n\r<{}\"'") or (end >= 0 and not name.strip()):
        raise Malformed("a tag's name")
    if end < 0 and final:
        raise Malformed("an unclosed tag")
    return end if end >= 0 else None

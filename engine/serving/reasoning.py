"""A reasoning model's thinking apart from its answer (`kiln serve --reasoning-parser`, vLLM's names), and a chat
choice's text split into reasoning, content and tool calls, streamed or whole.

    qwen3        a reply that opens with <think> thinks until </think>; so does one whose prompt opened <think>
                 (Qwen3.5/3.6, Qwen3-Thinking-2507 and QwQ's templates end the prompt with it); any other reply is
                 all answer (Qwen3's templates with enable_thinking false close <think></think> in the prompt)
    deepseek_r1  the reply thinks from its start (the chat template opened <think>) until </think>; a reply that
                 never closes it is all thinking

A reply thinking from its start that writes a tool call (`<tool_call>` then `<function=`, as Qwen3.5 does) before
any </think> has stopped thinking there, as vLLM reads it. A constrained reply (a JSON schema, a forced tool call) is
all answer unless it opens with <think> itself: its grammar holds it from the first token, so it never thinks.

As with the tool parsers, `split` reads the whole text so far, and what it returns only grows as the text does, a
partial tag held back until it is clear.
"""

from __future__ import annotations

import re
from typing import Any

from kiln.engine.serving.harmony import HarmonyReasoningParser
from kiln.engine.serving.partial_json import held_back
from kiln.engine.serving.tool_calls import ToolCallStream

START, END = "<think>", "</think>"
TOOL_CALL = re.compile(r"<tool_call>\s*<function[=\s]")  # a call written while thinking ends the thinking (vLLM)


class ReasoningParser:
    name = ""
    opens_thinking = False  # the reply thinks from its first token, <think> or not
    needs_special_tokens = False  # its markup holds special tokens (harmony's channels), which must reach the text

    def __init__(self) -> None:
        self.thinks_from_start = self.opens_thinking

    def read_request(self, prompt_tail: str, constrained: bool) -> None:
        """What the request says of how its reply begins: `prompt_tail`, the rendered prompt's last characters (a
        template that opens <think> ends with it); `constrained`, a reply held to a grammar from its first token."""
        if constrained:
            self.thinks_from_start = False
        elif prompt_tail.rstrip().endswith(START):
            self.thinks_from_start = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the text so far."""
        body = text.lstrip()
        if not final and START.startswith(body):
            return "", ""  # could still open with <think>
        if body.startswith(START):
            body = body[len(START) :]
        elif not self.thinks_from_start:
            return "", text
        end, call = body.find(END), TOOL_CALL.search(body)
        if call is not None and (end < 0 or call.start() < end):
            return body[: call.start()].lstrip("\n"), body[call.start() :]
        if end < 0:
            held = 0 if final else max(held_back(body, END), _tool_call_held(body))
            return body[: len(body) - held].lstrip("\n"), ""
        return body[:end].lstrip("\n"), body[end + len(END) :].lstrip()


def _tool_call_held(body: str) -> int:
    """How many characters at the end of the thinking so far could be a tool call's start (and must wait)."""
    last = body.rfind("<tool_call>")
    if last >= 0 and "<function".startswith(body[last + len("<tool_call>") :].lstrip()):
        return len(body) - last
    return held_back(body, "<tool_call>")


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_thinking = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, HarmonyReasoningParser)
}


class ChatReply:
    """One chat choice's text as OpenAI's reply fields: `reasoning_content` (with a reasoning parser), `content`,
    and `tool_calls` (with a tool parser, read from the answer part only)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallStream | None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.reasoning_sent = self.content_sent = 0

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        return self.reasoning.split(text, final) if self.reasoning is not None else (None, text)

    def update(self, text: str, final: bool) -> dict[str, Any]:
        """The delta to send now: reasoning_content, content, tool_calls (the keys with something new)."""
        reasoning, answer = self._split(text, final)
        delta: dict[str, Any] = {}
        if reasoning is not None and len(reasoning) > self.reasoning_sent:
            delta["reasoning_content"] = reasoning[self.reasoning_sent :]
            self.reasoning_sent = len(reasoning)
        if self.tools is not None:
            content, calls = self.tools.update(answer, final)
            if calls:
                delta["tool_calls"] = calls
        else:
            content = answer[self.content_sent :]
            self.content_sent = max(self.content_sent, len(answer))
        if content:
            delta["content"] = content
        return delta

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply's message fields."""
        reasoning, answer = self._split(text, True)
        message: dict[str, Any] = {"content": answer}
        if self.tools is not None:
            message["content"], calls = self.tools.message(answer)
            if calls:
                message["tool_calls"] = calls
        if reasoning is not None:
            message["reasoning_content"] = reasoning or None
            if reasoning and not message["content"]:  # a reply that only thought: no content (null, as vLLM's)
                message["content"] = None
        return message

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and bool(self.tools.last.calls)

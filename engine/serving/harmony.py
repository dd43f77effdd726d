"""The harmony format of gpt-oss's replies, read by channel: its reasoning parser (`--reasoning-parser openai_gptoss`)
and its tool-call parser (`--tool-call-parser openai`), vLLM's names.

A reply is a run of messages, each a header and a body between special tokens; the prompt ends `<|start|>assistant`,
so the first message opens at its channel::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A recipient may also stand in the role's part (`<|start|>assistant to=functions.get_weather<|channel|>commentary
json<|message|>`, as the chat template renders earlier calls). `<|return|>` and `<|call|>` are stop tokens
(generation_config.json), so a finished reply's text ends before them; `<|end|>` closes the messages before.

    analysis, no recipient                the reasoning: reasoning_content, a Responses API reasoning item
    final, or commentary no recipient     the answer's content (a commentary message is a preamble to calls)
    a recipient functions.NAME            a call of NAME, its body the arguments (JSON), streamed as it is written

The two parsers read the same messages. The reasoning parser gives the answer on to the tool parser (or, without one,
to the reply's content) as the content messages' text, each call kept as harmony markup: the tool parser reads that,
or the reply's raw text when no reasoning parser came first, and what is left of a call without a tool parser is its
markup, as any parser's calls stay text without it. Both read the whole text so far, and what they return only grows
as the text does: a message whose header is not complete is held back, as is a body's end that may be the start of a
special token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.engine.serving.partial_json import PartialCall, held_back
from kiln.engine.serving.tool_scan import Scan, ToolParser

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
# where a body ends: its message's end, or the next message's start (a reply that skipped the end token)
BODY_ENDS = (*ENDS, START)
RECIPIENT = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."


@dataclass
class Message:
    channel: str
    recipient: str | None  # "functions.get_weather", ...; None: to the user
    body: str
    done: bool  # its end came (or the reply did)

    @property
    def function(self) -> str | None:
        """The function a call addresses; None for a message that is no call."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :]

    @property
    def is_reasoning(self) -> bool:
        return self.channel == "analysis" and self.recipient is None


def read_messages(text: str, final: bool) -> tuple[str, list[Message]]:
    """(text before the first message, the messages so far). `final`: the reply has ended, so its last message has
    too; else a message whose header is not yet complete is left out and a body's last characters that may begin a
    special token are held back."""
    first = min((i for i in (text.find(START), text.find(CHANNEL)) if i >= 0), default=-1)
    if first < 0:  # no message (yet): plain text, as a constrained reply is
        return text if final else text[: len(text) - max(held_back(text, START), held_back(text, CHANNEL))], []
    messages, i = [], first
    while i < len(text):
        header_end = text.find(MESSAGE, i)
        if header_end < 0:  # (a header still coming: said once it is whole)
            break
        header = text[i:header_end]
        body_start = header_end + len(MESSAGE)
        found = [(text.find(t, body_start), t) for t in BODY_ENDS]
        end, end_token = min(((at, t) for at, t in found if at >= 0), default=(-1, ""))
        if end < 0:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - max(held_back(body, t) for t in BODY_ENDS)]
            messages.append(_message(header, body, final))
            break
        messages.append(_message(header, text[body_start:end], True))
        i = end if end_token == START else end + len(end_token)
    return text[:first], messages


def _message(header: str, body: str, done: bool) -> Message:
    """A message from its header's text (`[<|start|>ROLE[ to=R]]<|channel|>CHANNEL[ to=R][ [<|constrain|>]TYPE]`)."""
    recipient = RECIPIENT.search(header)
    _, _, channel_part = header.partition(CHANNEL)
    channel = channel_part.split(maxsplit=1)[0] if channel_part.strip() else ""
    channel = channel.split("<|", 1)[0]
    return Message(channel, recipient.group(1) if recipient else None, body, done)


def render_call(message: Message) -> str:
    """A call as harmony markup (the answer the reasoning parser gives on keeps calls so)."""
    end = "<|call|>" if message.done else ""
    return f"{START}assistant to={message.recipient}{CHANNEL}{message.channel} json{MESSAGE}{message.body}{end}"


class HarmonyReasoningParser:
    """`--reasoning-parser openai_gptoss`: the analysis messages are the reasoning (joined by newlines), the rest the
    answer (see the module's docstring). The interface of `reasoning.ReasoningParser`."""

    name = "openai_gptoss"
    needs_special_tokens = True  # the channels are special tokens, which a detokenizer skipping them would drop

    def read_request(self, prompt_tail: str, constrained: bool) -> None:
        """(A constrained reply is the grammar's JSON, no message at all: `read_messages` takes it as plain text.)"""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the text so far."""
        plain, messages = read_messages(text, final)
        reasoning = "\n".join(m.body for m in messages if m.is_reasoning)
        answer, after_content = plain, bool(plain)  # (content messages joined by newlines; a call's markup delimits)
        for message in messages:
            if message.is_reasoning:
                continue
            if message.recipient is not None:
                answer, after_content = answer + render_call(message), False
            else:
                answer, after_content = answer + ("\n" if after_content else "") + message.body, True
        return reasoning, answer


class HarmonyToolParser(ToolParser):
    """`--tool-call-parser openai`: the messages addressed to functions.NAME are calls of NAME with their bodies as
    arguments; the final and preamble messages are content, the analysis ones (the reasoning parser's) neither."""

    name = "openai"
    needs_special_tokens = True

    def _scan(self, text: str, final: bool) -> Scan:
        plain, messages = read_messages(text, final)
        content = [plain] if plain else []
        calls = []
        for message in messages:
            if message.function is not None:
                calls.append(
                    PartialCall(message.function, message.body or ("{}" if message.done else ""), message.done)
                )
            elif not message.is_reasoning and message.recipient is None:
                content.append(message.body)
        return Scan("\n".join(content), calls)

    def _content_before_markup(self, text: str) -> str:
        """The content before the first call (a stream's, when the calls cannot be read: a tool not offered)."""
        plain, messages = read_messages(text, False)
        content = [plain] if plain else []
        for message in messages:
            if message.recipient is not None:
                break
            if not message.is_reasoning:
                content.append(message.body)
        return "\n".join(content)

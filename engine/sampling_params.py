"""Per-request sampling parameters, with vLLM's names and defaults.

Every field is checked once, at construction, so the sampler and the scheduler can trust them: a
bad value raises ``ValueError`` naming the parameter, the value and the allowed range. The API
server turns that message into an HTTP 400 as is.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, NoReturn

# Below this temperature a request is greedy: dividing logits by ~0 would overflow, and the
# distribution is a point mass on the argmax anyway (vLLM uses the same threshold).
SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_ABS_LOGIT_BIAS = 100.0
MAX_STOP_TOKEN_IDS = 1024
MIN_REPETITION_PENALTY = 0.001
# Counts and token ids: what the wire (msgpack carries 64 bits) and the sampler's int32 tensors both hold.
MAX_INT = 2**31 - 1
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# A schema, regex or grammar is compiled and cached whole: bound what one request may hand over.
MAX_STRUCTURED_OUTPUT_CHARS = 256 * 1024


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _fail(name: str, value: Any, allowed: str) -> NoReturn:
    shown = repr(value)  # (a value of megabytes is not sent back whole)
    raise ValueError(f"{name} must be {allowed}, got {shown if len(shown) <= 200 else shown[:200] + '...'}")


def _is_int(value: Any) -> bool:
    # NOTE: bool is an int subclass; `top_k=True` is a caller bug, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    allowed = "an integer" + (
        f" in [{low}, {high}]" if low is not None and high is not None else f" >= {low}" if low is not None else ""
    )
    if not _is_int(value):
        _fail(name, value, allowed)
    if (low is not None and value < low) or (high is not None and value > high):
        _fail(name, value, allowed)
    return int(value)


def _check_float(name: str, value: Any, low: float, high: float, allowed: str) -> float:
    """A finite real in [low, high]; callers with an open bound check it themselves."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        _fail(name, value, allowed)
    try:
        value = float(value)
    except OverflowError:  # an integer past a float's range (JSON's `1` and 400 zeros)
        _fail(name, value, allowed)
    if not math.isfinite(value) or not low <= value <= high:
        _fail(name, value, allowed)
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(name, value, "a bool")
    return value


@dataclass(frozen=True)
class StructuredOutputParams:
    """One constraint on a request's output, compiled to a grammar (by xgrammar) that masks the logits.

    Exactly one field is set (vLLM's names): ``json``, a JSON schema (a dict, or its JSON text);
    ``json_object``, any JSON object; ``regex``; or ``grammar``, in EBNF (GBNF, as llama.cpp writes it).
    ``json`` is normalised to compact JSON text, key order kept (a schema's property order is the
    output's), so one schema is one cache entry however it was given.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check_bool("structured_output.json_object", self.json_object)
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_output must set exactly one of json, json_object, regex, grammar; "
                f"got {', '.join(given) or 'none'}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"structured_output.{name}", value, "a non-empty string")
        if self.json is not None:
            object.__setattr__(self, "json", _checked_schema(self.json))
        if len(self.spec) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValueError(
                f"structured_output.{self.kind} must be at most {MAX_STRUCTURED_OUTPUT_CHARS} "
                f"characters, got {len(self.spec)}"
            )

    @property
    def kind(self) -> str:
        """``json``, ``json_object``, ``regex`` or ``grammar``."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: with ``kind``, the key of its compiled grammar."""
        return "" if self.json_object else getattr(self, self.kind)


def _checked_schema(schema: Any) -> str:
    allowed = "a JSON schema object (a dict or its JSON text)"
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"structured_output.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        _fail("structured_output.json", schema, allowed)
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"structured_output.json cannot be written as JSON: {e}") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request, and when to stop.

    Defaults are vLLM's. ``stop`` and ``stop_token_ids`` are normalised to lists and ``logit_bias``
    to a fresh ``dict[int, float]``, so readers never branch on their input form. Frozen: derive a
    changed copy with ``dataclasses.replace`` (which re-validates).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs besides the sampled token's; 0 = the sampled one only
    # each prompt token's logprob (and the top k besides); such a request's prefill skips the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutputParams | dict[str, Any] | None = None  # a dict: its fields (the wire form)

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {
            "n": _check_int("n", self.n, 1, MAX_N),
            "temperature": _check_float("temperature", self.temperature, 0.0, math.inf, "a finite float >= 0"),
            "top_p": _check_float("top_p", self.top_p, 0.0, 1.0, "a float in (0, 1]"),
            "top_k": _check_int("top_k", self.top_k, -1, MAX_INT),
            "min_p": _check_float("min_p", self.min_p, 0.0, 1.0, "a float in [0, 1]"),
            "presence_penalty": _check_float(
                "presence_penalty", self.presence_penalty, -2.0, 2.0, "a float in [-2, 2]"
            ),
            "frequency_penalty": _check_float(
                "frequency_penalty", self.frequency_penalty, -2.0, 2.0, "a float in [-2, 2]"
            ),
            # (past these, a penalty scales logits to infinity: NaN probabilities, every completion over at once)
            "repetition_penalty": _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                MIN_REPETITION_PENALTY,
                1 / MIN_REPETITION_PENALTY,
                f"a float in [{MIN_REPETITION_PENALTY:g}, {1 / MIN_REPETITION_PENALTY:g}]",
            ),
            "ignore_eos": _check_bool("ignore_eos", self.ignore_eos),
            "skip_special_tokens": _check_bool("skip_special_tokens", self.skip_special_tokens),
            "include_stop_str_in_output": _check_bool("include_stop_str_in_output", self.include_stop_str_in_output),
            "min_tokens": _check_int("min_tokens", self.min_tokens, 0, MAX_INT),
            "logit_bias": self._checked_logit_bias(),
            "stop": self._checked_stop(),
            "stop_token_ids": self._checked_stop_token_ids(),
            "structured_output": self._checked_structured_output(),
        }
        if checked["top_p"] == 0.0:
            _fail("top_p", self.top_p, "a float in (0, 1]")
        if self.seed is not None:
            checked["seed"] = _check_int("seed", self.seed, _SEED_MIN, _SEED_MAX)
        if self.max_tokens is not None:
            checked["max_tokens"] = _check_int("max_tokens", self.max_tokens, 1, MAX_INT)
            if checked["min_tokens"] > checked["max_tokens"]:
                _fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            checked["logprobs"] = _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            checked["prompt_logprobs"] = _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def _checked_logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", self.logit_bias, "a dict of token id -> float")
        bias: dict[int, float] = {}
        for token_id, value in self.logit_bias.items():
            # OpenAI's JSON sends string keys; the API server converts them, not this class.
            if not _is_int(token_id) or not 0 <= token_id <= MAX_INT:
                _fail("logit_bias", self.logit_bias, "keyed by non-negative integer token ids")
            bias[int(token_id)] = _check_float(
                f"logit_bias[{token_id}]",
                value,
                -MAX_ABS_LOGIT_BIAS,
                MAX_ABS_LOGIT_BIAS,
                f"a finite float in [{-MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
            )
        return bias

    def _checked_stop(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            return []
        allowed = (
            f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings, "
            f"each at most {MAX_STOP_STRING_CHARS} characters"
        )
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS:
            _fail("stop", self.stop, allowed)
        # (a stream holds back as much text as its longest stop string, and matches each against it)
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop):
            _fail("stop", self.stop, allowed)
        return list(stop)

    def _checked_structured_output(self) -> StructuredOutputParams | None:
        value = self.structured_output
        if isinstance(value, dict):
            names = {f.name for f in fields(StructuredOutputParams)}
            if not set(value) <= names:
                _fail("structured_output", value, f"a dict with keys among {sorted(names)}")
            return StructuredOutputParams(**value)
        if value is not None and not isinstance(value, StructuredOutputParams):
            _fail("structured_output", value, "a StructuredOutputParams or a dict of its fields")
        return value

    def _checked_stop_token_ids(self) -> list[int]:
        if self.stop_token_ids is None:
            return []
        allowed = f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative integer token ids"
        if not isinstance(self.stop_token_ids, (list, tuple)):
            _fail("stop_token_ids", self.stop_token_ids, allowed)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # (the message names the count, not the ids)
            _fail("stop_token_ids", f"{len(self.stop_token_ids)} ids", allowed)
        bad = [t for t in self.stop_token_ids if not (_is_int(t) and 0 <= t <= MAX_INT)]
        if bad:
            _fail("stop_token_ids", bad[:5], allowed)
        return [int(t) for t in self.stop_token_ids]

    def verify_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if a token id named by these params is outside ``[0, vocab_size)``.

        Called once when a request is admitted: an out-of-range id would index past the logits on
        the device, which is a device-side assert, not a clean error.
        """
        for name, token_ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids or [])):
            bad = [t for t in token_ids if t >= vocab_size]
            if bad:
                _fail(
                    name,
                    self.logit_bias if name == "logit_bias" else self.stop_token_ids,
                    f"token ids in [0, {vocab_size}) (out of range: {bad[:5]})",
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """`stop_token_ids` to look a sampled token up in (the scheduler does, for every token)."""
        return frozenset(self.stop_token_ids)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

"""API keys with per-key limits, enforced in the API server before a request reaches the engine.

`kiln serve --api-keys-file keys.toml` reads a file of keys with names and limits (`api_key_file`). SIGHUP reloads
the file; a bad file is logged and the old keys stay. Per-key state is kept by name, so a reload keeps buckets and
usage.

Limits are token buckets refilled continuously: a limit of R per minute holds up to R and gains
R/60 each second. A request is admitted only when every limit allows it, and then takes from all of
them at once (a rejected request takes nothing). Every sequence counts (prompts x n): the token bucket must
hold the prompt tokens of every sequence and, as OpenAI counts it, max_tokens for each, before a request is
admitted; a request that names no max_tokens gets the most the bucket can pay for (`fit_max_tokens`). Prompt tokens
are charged at admission, generated tokens as they arrive. A request's limits are checked before any work is done
for it (tokenizing, checking its constraints): a key at its limits costs the server nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.engine.serving.api_key_file import KeyEntry, KeyFileError, KeyLimits, hash_key, load_key_file
from kiln.engine.serving.metrics import KeyMetrics
from kiln.engine.serving.openai_requests import APIError, ParsedRequest

logger = logging.getLogger("kiln")

Clock = Callable[[], float]


# ---- token bucket --------------------------------------------------------------------------------------


class TokenBucket:
    """Holds up to `capacity` tokens and refills continuously at `per_second`; starts full.

    `take` may drive the level below zero (generated tokens are charged after the fact); the bucket
    then needs the deficit refilled before `wait_for` reports it ready again.
    """

    def __init__(self, capacity: float, per_second: float, clock: Clock = time.monotonic) -> None:
        self.capacity, self.per_second, self.clock = capacity, per_second, clock
        self._level = float(capacity)
        self._stamp = clock()

    @classmethod
    def per_minute(cls, limit: int, clock: Clock = time.monotonic) -> TokenBucket:
        return cls(limit, limit / 60.0, clock)

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` tokens are there (0.0: now); inf if more than the bucket holds."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.per_second)

    def take(self, amount: float) -> None:
        self._refill()
        self._level -= amount

    def resize(self, capacity: float, per_second: float) -> None:
        """A reload changed the limit: what was refilled at the old rate stays, capped at the new capacity."""
        self._refill()
        self.capacity, self.per_second = capacity, per_second
        self._level = min(self._level, capacity)

    def _refill(self) -> None:
        now = self.clock()
        self._level = min(self.capacity, self._level + (now - self._stamp) * self.per_second)
        self._stamp = now


def invalid_key_error() -> APIError:
    return APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")


def retry_after(seconds: float) -> int:
    """Whole seconds to wait, rounded up (at least 1), for a `Retry-After` header."""
    # NOTE: the tolerance keeps float noise (2.0000000001) from adding a whole second
    return max(1, math.ceil(seconds - 1e-6))


# ---- per-key state and admission ------------------------------------------------------------------------


class RateLimited(APIError):
    """A 429 with a Retry-After header (the error middleware sends `headers`)."""

    def __init__(self, message: str, type_: str, retry_after_s: int) -> None:
        super().__init__(429, message, type_=type_, code="rate_limit_exceeded")
        self.headers = {"Retry-After": str(retry_after_s)}


@dataclass
class KeyUsage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason (a limit's name) -> count


class KeyState:
    """One key's limits, buckets, in-flight count and usage since the server started."""

    def __init__(self, entry: KeyEntry, metrics: KeyMetrics | None, clock: Clock) -> None:
        self.name, self.sha256, self.clock, self.metrics = entry.name, entry.sha256, clock, metrics
        self.limits = KeyLimits()
        self.requests_bucket: TokenBucket | None = None
        self.tokens_bucket: TokenBucket | None = None
        self.in_flight = 0
        self.usage = KeyUsage()
        self.revoked = False  # removed by a reload: a request authenticated before it is not admitted
        self.update(entry)

    def update(self, entry: KeyEntry) -> None:
        """New limits (or a new key under the same name) from a reload; the buckets keep their levels."""
        old, new = self.limits, entry.limits
        self.requests_bucket = self._bucket(self.requests_bucket, old.requests_per_minute, new.requests_per_minute)
        self.tokens_bucket = self._bucket(self.tokens_bucket, old.tokens_per_minute, new.tokens_per_minute)
        self.sha256, self.limits = entry.sha256, new

    def _bucket(self, bucket: TokenBucket | None, old: int | None, new: int | None) -> TokenBucket | None:
        if new is None:
            return None
        if bucket is None:
            return TokenBucket.per_minute(new, self.clock)
        if new != old:
            bucket.resize(new, new / 60.0)
        return bucket

    def reject(self, reason: str) -> None:
        self.usage.rejected[reason] = self.usage.rejected.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.rejected(self.name, reason)

    def apply_max_tokens(self, parsed: ParsedRequest, body: dict[str, Any], room: int | None = None) -> None:
        """A request asking for more than the key's cap gets a 400 (as OpenAI answers a max_tokens over
        the model's limit); one that names none gets its default, lowered to the cap. Chat's default is
        `room`, what the context leaves after the prompt: it becomes the smaller of the two, so the cap
        never turns a request that names no max_tokens into a context-length error."""
        cap = self.limits.max_tokens
        if cap is None:
            return
        asked = body.get("max_tokens")
        if asked is None and parsed.messages is not None:
            asked = body.get("max_completion_tokens")
        current = parsed.params.max_tokens
        if asked is not None and current is not None and current > cap:
            self.reject("max_tokens")
            raise APIError(400, f"max_tokens={current} is more than this API key allows ({cap})", "max_tokens")
        if current is None or current > cap:
            lowered = cap if current is not None or room is None else max(1, min(cap, room))
            try:
                parsed.params = replace(parsed.params, max_tokens=lowered)
            except ValueError as e:  # min_tokens above the cap
                self.reject("max_tokens")
                raise APIError(400, f"{e} (this API key's max_tokens cap is {cap})", "min_tokens") from None

    def fit_max_tokens(self, parsed: ParsedRequest, num_prompt_tokens: int, num_sequences: int, room: int) -> None:
        """A request that names no max_tokens (chat may generate until the context is full) gets the most each of its
        `num_sequences` may generate that the token bucket can pay for now beside its prompt tokens, at least 1 and
        at most `room` (what the context leaves): so the bucket's admission holds for it as for any other. NOTE: with
        no reservation, `n: 16` on a key of 3,000 tokens a minute once drew 8,128 tokens."""
        if self.tokens_bucket is None or parsed.params.max_tokens is not None:
            return
        affordable = int((self.tokens_bucket.level - num_prompt_tokens) // max(num_sequences, 1))
        parsed.params = replace(parsed.params, max_tokens=max(1, min(room, affordable)))

    def check_seat(self, num_prompt_tokens: int | None = None, num_completion_tokens: int = 0) -> None:
        """Raise (401, 400 or 429) unless a request with this many prompt tokens (and at most this many completion
        tokens) may go now; takes nothing. The API calls it before tokenizing (None: all but the token bucket, so a
        key at its limits costs the shared tokenizer pool nothing), and `admit` again with the tokens."""
        if self.revoked:
            raise invalid_key_error()
        limits = self.limits
        if limits.max_concurrent_requests is not None and self.in_flight >= limits.max_concurrent_requests:
            self.reject("max_concurrent_requests")
            # NOTE: when a seat frees depends on other requests; 1 s tells a client to poll, not to hammer
            raise RateLimited(
                f"this API key may have {limits.max_concurrent_requests} requests in flight; wait for one to finish",
                "concurrent_requests",
                1,
            )
        waits: dict[str, float] = {}
        if self.requests_bucket is not None:
            waits["requests_per_minute"] = self.requests_bucket.wait_for(1)
        if self.tokens_bucket is not None and num_prompt_tokens is not None:
            needed = num_prompt_tokens + num_completion_tokens
            waits["tokens_per_minute"] = self.tokens_bucket.wait_for(needed)
            if math.isinf(waits["tokens_per_minute"]):
                self.reject("tokens_per_minute")
                asked = f"{num_prompt_tokens} prompt tokens"
                if num_completion_tokens:
                    asked += f" and up to {num_completion_tokens} completion tokens (max_tokens for every sequence)"
                raise APIError(
                    400,
                    f"this request's {asked} are more than this API key's tokens_per_minute "
                    f"({limits.tokens_per_minute}); no wait will admit it",
                    "max_tokens" if num_completion_tokens > num_prompt_tokens else "prompt",
                    code="request_too_large",
                )
        reason, wait = max(waits.items(), key=lambda kv: kv[1], default=("", 0.0))
        if wait > 0:
            self.reject(reason)
            seconds = retry_after(wait)
            limit = getattr(limits, reason)
            kind = "requests" if reason == "requests_per_minute" else "tokens"
            raise RateLimited(
                f"rate limit reached for this API key: {reason} = {limit}; try again in {seconds} s", kind, seconds
            )

    def admit(self, num_prompt_tokens: int, num_completion_tokens: int = 0) -> None:
        """Admit one request with this many prompt tokens (all its sequences') and at most this many completion
        tokens, or raise (401, 400 or 429) and take nothing. Only the prompt tokens are taken now."""
        self.check_seat(num_prompt_tokens, num_completion_tokens)
        if self.requests_bucket is not None:
            self.requests_bucket.take(1)
        self.in_flight += 1
        self.usage.requests += 1
        if self.metrics is not None:
            self.metrics.admitted(self.name)
        self.charge(num_prompt_tokens, prompt=True)

    def charge(self, num_tokens: int, prompt: bool = False) -> None:
        if self.tokens_bucket is not None:
            self.tokens_bucket.take(num_tokens)
        if prompt:
            self.usage.prompt_tokens += num_tokens
        else:
            self.usage.completion_tokens += num_tokens
        if self.metrics is not None:
            self.metrics.tokens(self.name, num_tokens, prompt)

    def release(self) -> None:
        self.in_flight -= 1

    def revoke(self) -> None:
        """Removed from the key file: no more admissions; what is in flight finishes, out of /metrics."""
        self.revoked = True
        self.metrics = None

    def usage_body(self) -> dict[str, Any]:
        """GET /v1/usage: this key's limits, what is left in its buckets now, and its usage since start."""
        u = self.usage
        requests_left = None if self.requests_bucket is None else round(self.requests_bucket.level, 3)
        tokens_left = None if self.tokens_bucket is None else round(self.tokens_bucket.level, 3)
        total = u.prompt_tokens + u.completion_tokens
        usage = {
            "requests": u.requests,
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": total,
            "rejected_requests": dict(u.rejected),
        }
        return {
            "object": "usage",
            "key_name": self.name,
            "limits": asdict(self.limits),
            "remaining": {"requests": requests_left, "tokens": tokens_left},
            "in_flight_requests": self.in_flight,
            "usage": usage,
        }


class KeyStore:
    """The keys of `--api-keys-file`, looked up by the SHA-256 of the bearer token; reloadable."""

    def __init__(self, path: str | Path, metrics: KeyMetrics | None = None, clock: Clock = time.monotonic) -> None:
        self.path, self.metrics, self.clock = Path(path), metrics, clock
        self._by_name: dict[str, KeyState] = {}
        self._by_hash: dict[str, KeyState] = {}
        self.reload()

    def __len__(self) -> int:
        return len(self._by_name)

    def authenticate(self, authorization: str) -> KeyState | None:
        """The key of an `Authorization: Bearer KEY` header, or None."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        # NOTE: a dict lookup on the digest: timing can reveal at most digest prefixes, which say nothing of a key
        return self._by_hash.get(hash_key(token.strip()))

    def reload(self) -> tuple[list[str], list[str]]:
        """Read the file again and swap the keys in at once; returns the names added and removed.
        Raises KeyFileError (and changes nothing) when the file is bad."""
        entries = load_key_file(self.path)
        by_name: dict[str, KeyState] = {}
        for entry in entries:
            state = self._by_name.get(entry.name)
            if state is None:
                state = KeyState(entry, self.metrics, self.clock)
            else:
                state.update(entry)
            by_name[entry.name] = state
        added = sorted(set(by_name) - set(self._by_name))
        removed = sorted(set(self._by_name) - set(by_name))
        # NOTE: requests in flight keep their KeyState, so a revoked key's open streams finish normally
        for name in removed:
            self._by_name[name].revoke()
        self._by_name, self._by_hash = by_name, {s.sha256: s for s in by_name.values()}
        if self.metrics is not None:
            self.metrics.keys_loaded(list(by_name), removed)
        return added, removed

    def reload_or_keep(self) -> bool:
        """SIGHUP: reload, logging key names (never keys); on a bad file log why and keep the old keys."""
        try:
            added, removed = self.reload()
        except KeyFileError as e:
            logger.error("API keys not reloaded, the old keys stay: %s", e)
            if self.metrics is not None:
                self.metrics.reloaded(ok=False)
            return False
        logger.info(
            "API keys reloaded from %s: %d keys (added: %s; removed: %s)",
            self.path,
            len(self),
            ", ".join(added) or "none",
            ", ".join(removed) or "none",
        )
        if self.metrics is not None:
            self.metrics.reloaded(ok=True)
        return True

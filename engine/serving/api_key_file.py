"""The API keys file (`kiln serve --api-keys-file keys.toml`): keys stored as the SHA-256 of the key (never the key
itself), each with a name and optional limits, checked whole when read.

    [[keys]]
    name = "alice"                 # shown in /metrics and /v1/usage; never the key
    sha256 = "2bd806c9..."         # printf %s "$KEY" | sha256sum
    requests_per_minute = 60
    tokens_per_minute = 20000      # prompt + generated
    max_concurrent_requests = 4
    max_tokens = 512               # per request: more is a 400, none given gets min(default, cap)

(`.json` files hold the same as `{"keys": [{...}, ...]}`.)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_tokens")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class KeyEntry:
    name: str
    sha256: str  # hex digest of the key
    limits: KeyLimits


def hash_key(key: str) -> str:
    # NOTE: aiohttp hands a header's non-UTF-8 bytes over as lone surrogates (surrogateescape): they hash to no key
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def load_key_file(path: str | Path) -> list[KeyEntry]:
    """Parse and check a key file; any problem raises KeyFileError naming the file, the entry and the field."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read the API keys file {path}: {e.strerror}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise KeyFileError(f"{path}: not valid JSON: {e}") from None
    else:
        try:
            data = tomllib.loads(raw.decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise KeyFileError(f"{path}: not valid TOML: {e}") from None
    return parse_keys(data, str(path))


def parse_keys(data: Any, source: str = "the API keys file") -> list[KeyEntry]:
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise KeyFileError(f"{source}: expected a list 'keys' of tables ([[keys]] in TOML)")
    if extra := sorted(set(data) - {"keys"}):
        raise KeyFileError(f"{source}: unknown top-level field(s) {', '.join(extra)}")
    entries: list[KeyEntry] = []
    names: set[str] = set()
    hashes: set[str] = set()
    for i, item in enumerate(data["keys"]):
        where = f"{source}: keys[{i}]"
        if not isinstance(item, dict):
            raise KeyFileError(f"{where} must be a table")
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise KeyFileError(f"{where} needs a non-empty string 'name'")
        if not name.isprintable():  # a name goes into logs and /metrics labels: a newline there would forge lines
            raise KeyFileError(f"{where}: the name {name!r} holds a control character (a newline, a tab, ...)")
        where = f"{where} ({name!r})"
        if extra := sorted(set(item) - {"name", "sha256", *LIMITS}):
            raise KeyFileError(f"{where}: unknown field(s) {', '.join(extra)}; limits are {', '.join(LIMITS)}")
        digest = item.get("sha256")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.lower()):
            # NOTE: the value is not echoed: someone may have pasted the key itself here
            raise KeyFileError(f"{where}: 'sha256' must be 64 hex digits, the SHA-256 of the key (never the key)")
        digest = digest.lower()
        limits = {}
        for limit in LIMITS:
            value = item.get(limit)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise KeyFileError(f"{where}: {limit!r} must be a positive integer, got {value!r}")
            limits[limit] = value
        if name in names:
            raise KeyFileError(f"{where}: the name is used by another key")
        if digest in hashes:
            raise KeyFileError(f"{where}: the same key (sha256) is listed twice")
        names.add(name)
        hashes.add(digest)
        entries.append(KeyEntry(name, digest, KeyLimits(**limits)))
    return entries

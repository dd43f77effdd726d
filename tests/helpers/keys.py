"""API keys and key files for the `--api-keys-file` tests."""

from __future__ import annotations

import hashlib
import json
import os

ALICE, BOB, CAROL, DAVE, ERIN, FRANK = (
    f"sk-test-{n}-0123456789" for n in ("alice", "bob", "carol", "dave", "erin", "frank")
)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def toml_keys(*entries: dict) -> str:
    def value(v):
        return json.dumps(v)  # JSON strings and integers are valid TOML

    return "".join("[[keys]]\n" + "".join(f"{k} = {value(v)}\n" for k, v in e.items()) + "\n" for e in entries)


def write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a reload never reads half a file

"""The checks every request parser shares: OpenAI's error object, and one body field checked for its kind."""

from __future__ import annotations

import math
from typing import Any


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def check_field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(400, f"'{name}' must be a finite number", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def context_overflow(
    max_model_len: int, where: str, prompt_tokens: int | str, completion_tokens: int | None = None, param: str = ""
) -> APIError:
    """A request past the context, in OpenAI's words (clients such as LiteLLM recognise "maximum context length" and
    the code). `where`: "prompt" or "messages"; `completion_tokens`: the completion's part when the prompt alone
    fits; `param`: the parameter named (default `where`)."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if completion_tokens is None:
        message = f"your {where} resulted in {prompt_tokens} tokens. Please reduce the length of the {where}."
    else:
        message = (
            f"you requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the {where}, "
            f"{completion_tokens} in the completion). Please reduce the length of the {where} or completion."
        )
    return APIError(400, head + message, param or where, code="context_length_exceeded")

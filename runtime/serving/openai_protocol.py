"""The OpenAI API's wire format for ``tieredkv serve``: the request bodies (strict types: a
JSON string is never read as a number, a number never as a boolean), the error object, the
messages of validation errors, and server-sent events. docs/openai-server.md lists every
field and what is refused."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from tieredkv.errors import ConfigError, TieredKVError


class ServerUnavailableError(TieredKVError, ImportError):
    """The server's dependencies (fastapi, uvicorn) are not installed."""


try:
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
except ImportError as exc:  # the CLI prints this as `error: ...`
    raise ServerUnavailableError(f"the OpenAI-compatible server needs fastapi and uvicorn ({exc}); install them "
                                 "with: pip install 'tieredkv[serve]'") from None

#: the engine's finish reasons that end a choice normally, as OpenAI names them
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


# ------------------------------------------------------------------------------ errors
class OpenAIError(Exception):
    """An error answered as OpenAI does: ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def not_running() -> OpenAIError:
    return OpenAIError(503, "the engine is not running (the server is shutting down or the engine failed); "
                            "retry against a running server", code="engine_unavailable")


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down and takes no new requests; retry against another "
                            "replica or once it is back", code="server_shutting_down")


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union it tried in an error's location: ``str``, ``list[int]``."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A short, readable message from pydantic's errors (no input values, at most three). A
    value matching no member of a union is one error naming the members."""
    errors, unions = [], {}
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        tag = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
        if tag is None:
            errors.append(err)
            continue
        key = tuple(loc[:tag])
        if key not in unions:
            unions[key] = []
            errors.append({"type": "union", "loc": key, "tags": unions[key]})
        if loc[tag] not in unions[key]:
            unions[key].append(loc[tag])
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err["type"] == "union":
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'request body'}: expected one of {', '.join(err['tags'])}")
            continue
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON ({detail})" if detail else
                         "the request body is not valid JSON")
            continue
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "missing":
            parts.append(f"missing required field '{where}'" if where else "missing request body (a JSON object)")
        else:
            parts.append(f"{where}: {err.get('msg')}" if where else f"request body: {err.get('msg')}")
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more error(s)")
    return "; ".join(parts) or "invalid request", param


#: SamplingParams field names -> the request fields that set them (for ConfigError messages)
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                "seed": "seed", "stop": "stop"}


def sampling_error(exc: ConfigError, max_tokens_name: str) -> OpenAIError:
    msg = str(exc)
    first = msg.split(" ", 1)[0]
    param = _PARAM_NAMES.get(first)
    if first == "max_new_tokens":
        param = max_tokens_name
        msg = max_tokens_name + msg[len(first):]
    return bad_request(msg, param=param)


def is_json_content_type(value: str | None) -> bool:
    """``application/json`` or ``application/*+json``, with or without parameters (charset)."""
    if not value:
        return False
    kind = value.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


# ------------------------------------------------------------------------------ request bodies
class _Strict(BaseModel):
    """Strict types (a JSON number is not read from a string, a boolean is not a number: "4",
    true and "yes" are refused where an integer or a boolean is expected; an integer is a
    valid number); unknown fields are accepted and ignored (logged)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields common to both endpoints."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 disables it
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM): keep generating past the end-of-sequence token
    cache_salt: str | None = None  # extension (vLLM): requests with different salts never share prefix pages
    return_token_ids: bool = False  # extension (vLLM): the prompt's and each choice's token ids


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension (vLLM)


# ------------------------------------------------------------------------------ server-sent events
def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart", "FINISH_REASONS",
           "OpenAIError", "SSE_DONE", "ServerUnavailableError", "StreamOptions", "bad_request", "is_json_content_type",
           "not_running", "sampling_error", "shutting_down", "sse", "validation_message"]

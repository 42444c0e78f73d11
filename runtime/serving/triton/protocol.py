"""The Triton model's interface: its inputs and outputs (Triton's vLLM backend's names and
types, so the same clients work), and how a request's tensors and parameters become a
prompt, SamplingParams and response options. Plain Python: no Triton import here, the
repository writer and the docs read the same tables.

Sampling parameters come from the optional ``sampling_parameters`` input (a JSON object, as
in the vLLM backend) and from the request's parameters (gRPC/HTTP request ``parameters``; the
HTTP generate endpoint puts its ``parameters`` object and any extra top-level keys there);
``sampling_parameters`` wins where both name a key. Numbers and booleans may be given as
strings (BLS and some clients only send strings). Unknown keys are an error, not ignored: a
misspelt ``temprature`` would otherwise sample greedily without a word.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tieredkv.errors import ConfigError, short
from tieredkv.runtime.sampling import SamplingParams

#: (name, Triton data type, dims, optional, what it is)
INPUTS: list[tuple[str, str, list[int], bool, str]] = [
    ("text_input", "TYPE_STRING", [1], False, "the prompt (UTF-8 text, tokenized by the model's tokenizer)"),
    ("stream", "TYPE_BOOL", [1], True, "one response per generated token, each with the new text (default false: "
                                       "one response with the whole completion)"),
    ("sampling_parameters", "TYPE_STRING", [1], True, "a JSON object of sampling parameters (table below)"),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True, "leave the prompt out of text_output (default: false "
                                                        "without streaming — the prompt is prepended —, true with it)"),
    ("return_finish_reason", "TYPE_BOOL", [1], True, "add the finish_reason output"),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True, "add the num_input_tokens output"),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True, "add the num_output_tokens output"),
]
#: (name, Triton data type, dims, what it is)
OUTPUTS: list[tuple[str, str, list[int], str]] = [
    ("text_output", "TYPE_STRING", [-1], "the completion (streaming: the text new in this response)"),
    ("finish_reason", "TYPE_STRING", [-1], "eos, stop, length (empty while streaming until the last response)"),
    ("num_input_tokens", "TYPE_UINT32", [1], "prompt tokens"),
    ("num_output_tokens", "TYPE_UINT32", [1], "generated tokens (streaming: in this response)"),
]
OPTION_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
                 "return_num_output_tokens")
#: the sampling parameters: name -> (kind, what it is); vLLM's names
SAMPLING: dict[str, tuple[str, str]] = {
    "max_tokens": ("int", "the most tokens to generate (default 16, as vLLM)"),
    "temperature": ("float", "0 = greedy (default); else in [0.001, 100]"),
    "top_p": ("float", "nucleus sampling, (0, 1] (default 1: off)"),
    "top_k": ("int", "top-k sampling (default 0 or -1: off)"),
    "seed": ("int", "per-request sampling seed, [0, 2^63)"),
    "stop": ("stop", "a stop string or a list of them (not part of the output)"),
    "ignore_eos": ("bool", "go on past the end-of-sequence token (default false)"),
    "cache_salt": ("str", "tieredkv: requests with different salts never share prefix pages (per tenant)"),
}
DEFAULT_MAX_TOKENS = 16
ON_CANCEL = ("free", "keep")


@dataclass(frozen=True)
class Options:
    stream: bool = False
    prepend_input: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
        return v.strip().lower() in ("true", "1")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ConfigError(f"{name} must be a boolean, got {short(v)}")


def _int(name: str, v: Any) -> int:
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {short(v)}") from None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"{name} must be an integer, got {short(v)}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {short(v)}") from None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ConfigError(f"{name} must be a finite number, got {short(v)}")
    return float(v)


def parse_json_object(text: str | bytes | None, what: str) -> dict[str, Any]:
    if text is None:
        return {}
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{what} is not UTF-8") from None
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON ({exc.msg} at character {exc.pos}): {short(text)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object, got {short(data)}")
    return data


def parse_request(sampling_json: str | bytes | None, parameters_json: str | bytes | None,
                  tensors: dict[str, bool]) -> tuple[SamplingParams, str | None, Options]:
    """``sampling_json``: the ``sampling_parameters`` input (or None); ``parameters_json``: the
    request's parameters (``request.parameters()``); ``tensors``: the boolean option inputs
    present. Returns the SamplingParams, the cache salt and the response options; ConfigError
    with a message for the client on anything wrong."""
    merged = parse_json_object(parameters_json, "the request parameters")
    merged.update(parse_json_object(sampling_json, "sampling_parameters"))
    flags: dict[str, bool] = {}
    for name in OPTION_INPUTS:  # an option may come as a parameter too (a client without the input)
        if name in merged:
            flags[name] = _bool(name, merged.pop(name))
    flags.update({k: bool(v) for k, v in tensors.items() if k in OPTION_INPUTS})
    unknown = sorted(set(merged) - set(SAMPLING))
    if unknown:
        raise ConfigError(f"unknown sampling parameter(s) {unknown}; expected some of {sorted(SAMPLING)}")
    kw: dict[str, Any] = {"max_new_tokens": DEFAULT_MAX_TOKENS}
    salt = None
    for name, value in merged.items():
        kind = SAMPLING[name][0]
        if value is None:
            continue
        if name == "max_tokens":
            kw["max_new_tokens"] = _int(name, value)
        elif name == "top_k":
            k = _int(name, value)
            kw["top_k"] = 0 if k == -1 else k
        elif kind == "int":
            kw[name] = _int(name, value)
        elif kind == "float":
            kw[name] = _float(name, value)
        elif kind == "bool":
            kw[name] = _bool(name, value)
        elif kind == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ConfigError(f"stop must be a string or a list of strings, got {short(value)}")
            kw["stop"] = tuple(stops)
        elif name == "cache_salt":
            if not isinstance(value, str):
                raise ConfigError(f"cache_salt must be a string, got {short(value)}")
            salt = value
    params = SamplingParams(**kw)
    stream = flags.get("stream", False)
    if "exclude_input_in_output" in flags:
        prepend = not flags["exclude_input_in_output"]
    else:
        prepend = not stream
    if prepend and stream:
        raise ConfigError("exclude_input_in_output=false is not allowed with stream=true (each streamed response "
                          "carries only its new text)")
    opts = Options(stream=stream, prepend_input=prepend,
                   return_finish_reason=flags.get("return_finish_reason", False),
                   return_num_input_tokens=flags.get("return_num_input_tokens", False),
                   return_num_output_tokens=flags.get("return_num_output_tokens", False))
    return params, salt, opts


def decode_prompt(value: Any) -> str:
    """``text_input``'s first element as text."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("text_input is not UTF-8 text") from None
    if isinstance(value, str):
        return value
    raise ConfigError(f"text_input must be a string, got {short(value)}")

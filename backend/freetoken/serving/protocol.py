"""The request/response protocol of Triton's vLLM backend, so its clients work unchanged.

Pure Python over numpy arrays (no ``triton_python_backend_utils``): ``parse_request`` turns a
request's input tensors and parameters into a ``GenerateSpec`` or raises ``ProtocolError`` naming
the field; ``build_outputs`` turns engine outputs into output arrays. docs/serving.md documents
every field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from freetoken.core import RequestOutput, SamplingParams, TokenLogprobs
from freetoken.fields import field_types

TEXT_INPUT = "text_input"
INPUT_IDS = "input_ids"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
# return_<name> asks for the output <name>.
OPTIONAL_OUTPUTS = (
    "finish_reason",
    "cumulative_logprob",
    "logprobs",
    "num_input_tokens",
    "num_output_tokens",
    "num_cached_tokens",
    "output_ids",
)
BOOL_INPUTS = (STREAM, EXCLUDE_INPUT_IN_OUTPUT, *(f"return_{name}" for name in OPTIONAL_OUTPUTS))
INPUT_NAMES = (TEXT_INPUT, INPUT_IDS, SAMPLING_PARAMETERS, *BOOL_INPUTS)

InputGetter = Callable[[str], "np.ndarray | None"]


class ProtocolError(ValueError):
    """A request that breaks the protocol; the message names the offending input or field."""


@dataclass
class GenerateSpec:
    """One generate request, validated."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    prepend_input: bool  # non-streaming only: text_output starts with the prompt's text
    outputs: frozenset[str]  # the optional outputs asked for
    report_logprobs: bool  # sampling_parameters asked for logprobs; else the logprobs output is null


def _scalar(array: np.ndarray, name: str) -> Any:
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise ProtocolError(f"input '{name}' must hold exactly one element, got shape {list(np.shape(array))}")
    return flat[0]


def _bool_input(array: np.ndarray, name: str) -> bool:
    value = _scalar(array, name)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ProtocolError(f"input '{name}' must be BOOL, got {np.asarray(array).dtype}")


def _text(array: np.ndarray, name: str) -> str:
    value = _scalar(array, name)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"input '{name}' is not valid UTF-8: {exc}") from None
    if isinstance(value, str):
        return value
    raise ProtocolError(f"input '{name}' must be BYTES (a string), got {np.asarray(array).dtype}")


# ----- sampling parameters -----


# The scalar or list type each field takes (``float | None`` -> float; ``stop``, str or list[str]: object).
_FIELD_KINDS = {name: kind.kind for name, kind in field_types(SamplingParams).items()}


def _number(name: str, value: Any, kind: type) -> int | float:
    """A JSON number, or a string holding one (the vLLM backend's sample client sends "0.7")."""
    original = value
    if isinstance(value, str):
        try:
            value = float(value.strip()) if kind is float else int(value.strip())
        except ValueError:
            raise ProtocolError(f"sampling parameter '{name}' must be a number, got {original!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"sampling parameter '{name}' must be a number, got {original!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"sampling parameter '{name}' must be a finite number, got {original!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ProtocolError(f"sampling parameter '{name}' must be an integer, got {original!r}")
        return int(value)
    return float(value)


def _boolean(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ProtocolError(f"sampling parameter '{name}' must be a boolean, got {value!r}")


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELD_KINDS[name]
    if kind in (int, float):
        return _number(name, value, kind)
    if kind is bool:
        return _boolean(name, value)
    if name == "stop":
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            return value
        raise ProtocolError(f"sampling parameter 'stop' must be a string or a list of strings, got {value!r}")
    if name == "stop_token_ids":
        if isinstance(value, list):
            return [_number("stop_token_ids", v, int) for v in value]
        raise ProtocolError(f"sampling parameter 'stop_token_ids' must be a list of token ids, got {value!r}")
    raise ProtocolError(f"sampling parameter '{name}' has an unsupported value {value!r}")


# Keys of the vLLM backend that FreeToken refuses, with what it answers (``lora_name``: the vLLM
# backend's own text when LoRA is off).
_REFUSED = {
    "lora_name": "LoRA feature is not enabled.",
    "structured_outputs": "sampling parameter 'structured_outputs' is not supported: FreeToken has no structured "
                          "decoding (JSON schema, regex, choice, grammar) yet",
}


def parse_sampling_parameters(raw: str | dict[str, Any] | None, ignore: Sequence[str] = ()) -> SamplingParams:
    """``raw`` is the JSON object of vLLM SamplingParams fields (``null`` values mean unset).
    Keys in ``ignore`` are skipped (the generate endpoint puts its own keys among the parameters)."""
    if raw is None or raw == "":
        values: dict[str, Any] = {}
    elif isinstance(raw, dict):
        values = raw
    else:
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ProtocolError(f"{SAMPLING_PARAMETERS} is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ProtocolError(f"{SAMPLING_PARAMETERS} must be a JSON object, got {type(values).__name__}")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name in ignore or value is None:
            continue
        if name in _REFUSED:
            raise ProtocolError(_REFUSED[name])
        if name not in _FIELD_KINDS:
            raise ProtocolError(
                f"unknown sampling parameter '{name}' (supported: {', '.join(sorted(_FIELD_KINDS))})"
            )
        kwargs[name] = _coerce(name, value)
    params = SamplingParams(**kwargs)
    try:
        params.validate()
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    return params


# ----- requests -----


def parse_request(get_input: InputGetter, request_parameters: str | None = None) -> GenerateSpec:
    """Validate one request. ``get_input(name)`` returns an input's array or None when absent;
    ``request_parameters`` is the request's parameters as JSON, read when ``sampling_parameters``
    is absent (as the vLLM backend does)."""
    text, ids = get_input(TEXT_INPUT), get_input(INPUT_IDS)
    if (text is None) == (ids is None):
        raise ProtocolError(f"give exactly one of '{TEXT_INPUT}' and '{INPUT_IDS}'")
    prompt: str | list[int]
    if text is not None:
        prompt = _text(text, TEXT_INPUT)
        if not prompt:
            raise ProtocolError(f"input '{TEXT_INPUT}' must not be empty")
    else:
        array = np.asarray(ids)
        if array.dtype.kind not in "iu":
            raise ProtocolError(f"input '{INPUT_IDS}' must be INT32, got {array.dtype}")
        prompt = [int(i) for i in array.reshape(-1)]
        if not prompt:
            raise ProtocolError(f"input '{INPUT_IDS}' must not be empty")

    flags = {name: None for name in BOOL_INPUTS}
    for name in BOOL_INPUTS:
        array = get_input(name)
        if array is not None:
            flags[name] = _bool_input(array, name)
    stream = bool(flags[STREAM])
    exclude = flags[EXCLUDE_INPUT_IN_OUTPUT]
    if stream and exclude is False:  # the vLLM backend's text, which its clients match
        raise ProtocolError("Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.")
    outputs = frozenset(name for name in OPTIONAL_OUTPUTS if flags[f"return_{name}"])

    raw_params = get_input(SAMPLING_PARAMETERS)
    if raw_params is not None:
        params = parse_sampling_parameters(_text(raw_params, SAMPLING_PARAMETERS))
    else:
        params = parse_sampling_parameters(_request_parameters(request_parameters), ignore=INPUT_NAMES)
    report_logprobs = params.logprobs is not None
    if params.logprobs is None and "cumulative_logprob" in outputs:
        params.logprobs = 0  # the chosen tokens' logprobs are summed; the logprobs output stays null
    return GenerateSpec(prompt, params, stream, prepend_input=not stream and not exclude, outputs=outputs,
                        report_logprobs=report_logprobs)


def _request_parameters(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as exc:  # Triton itself produces this JSON; kept for safety
        raise ProtocolError(f"request parameters are not valid JSON: {exc}") from None
    return values if isinstance(values, dict) else {}


# ----- responses -----


def build_outputs(
    spec: GenerateSpec,
    latest: Sequence[RequestOutput | None],
    deltas: Sequence[Sequence[RequestOutput]],
    prompt_text: Callable[[], str],
    decode_token: Callable[[int], str],
) -> dict[str, np.ndarray]:
    """Output arrays of one response, one element per sample (``n`` of them, as the vLLM backend
    lays them out). ``latest[i]`` is sample i's newest engine output (None before its first);
    streaming: ``deltas[i]`` are its outputs since the previous response (merged here); otherwise
    every sample has finished and its whole text is sent. ``prompt_text()`` is called only when the
    prompt is prepended; ``decode_token`` spells a token id for ``logprobs``."""
    texts, token_ids, logprobs = [], [], []
    for last, delta in zip(latest, deltas):
        if spec.stream:
            texts.append("".join(o.new_text for o in delta))
            token_ids.append([t for o in delta for t in o.new_token_ids])
            logprobs.append([lp for o in delta for lp in (o.new_logprobs or [])])
        else:
            texts.append(prompt_text() + last.text if spec.prepend_input else last.text)
            token_ids.append(list(last.token_ids))
            logprobs.append(list(last.logprobs or []))
    arrays: dict[str, np.ndarray] = {"text_output": _strings(texts)}
    wanted = spec.outputs
    if "finish_reason" in wanted:  # the vLLM backend sends str(None) until a sample finishes
        arrays["finish_reason"] = _strings([str(o.finish_reason.value) if o is not None and o.finished else "None"
                                            for o in latest])
    if "cumulative_logprob" in wanted:
        arrays["cumulative_logprob"] = np.array([(o.cumulative_logprob if o is not None else None) or 0.0
                                                 for o in latest], dtype=np.float32)
    if "logprobs" in wanted:
        arrays["logprobs"] = _strings([json.dumps([_logprob_entry(t, lp, decode_token) for t, lp in zip(ids, lps)])
                                       if spec.report_logprobs else "null"
                                       for ids, lps in zip(token_ids, logprobs)])
    if "num_input_tokens" in wanted:
        prompt_ids = next(o.prompt_token_ids for o in latest if o is not None)
        arrays["num_input_tokens"] = np.array([len(prompt_ids)], dtype=np.uint32)
    if "num_output_tokens" in wanted:
        arrays["num_output_tokens"] = np.array([len(ids) for ids in token_ids], dtype=np.uint32)
    if "num_cached_tokens" in wanted:  # per sample: each is an engine request with its own prefill
        arrays["num_cached_tokens"] = np.array([o.num_cached_tokens if o is not None else 0 for o in latest],
                                               dtype=np.uint32)
    if "output_ids" in wanted:  # the samples' ids one after another (num_output_tokens splits them)
        arrays["output_ids"] = np.array([t for ids in token_ids for t in ids], dtype=np.int32)
    return arrays


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def _logprob_entry(token_id: int, logprobs: TokenLogprobs, decode_token: Callable[[int], str]) -> dict[str, dict]:
    """vLLM's layout of one position: the chosen token, then the top-k (ranks 1..k; a chosen token
    among them takes its top-k rank)."""
    ranked = [(token_id, logprobs.logprob, logprobs.rank)]
    ranked += [(t, lp, rank) for rank, (t, lp) in enumerate(logprobs.top, start=1)]
    return {str(t): {"logprob": lp, "rank": rank, "decoded_token": decode_token(t)} for t, lp, rank in ranked}

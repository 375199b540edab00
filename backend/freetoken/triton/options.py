"""config.pbtxt ``parameters`` <-> engine and backend options.

Every ``EngineConfig`` field is a parameter of the same name (``max_running_requests``); an empty
string means the field's default. ``BackendOptions`` are the serving layer's own knobs. Parameters
in capitals belong to Triton or its Python backend (``EXECUTION_ENV_PATH``) and are left alone;
any other unknown name fails the model load, so a typo cannot pass silently.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from freetoken.config import EngineConfig


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class BackendOptions:
    response_threads: int = _opt(2, "threads that send responses; each owns a share of the requests")
    cancel_poll_ms: float = _opt(100.0, "how often each response thread asks Triton whether its requests were cancelled")
    report_metrics: bool = _opt(True, "publish the freetoken_* metric families on Triton's metrics port")
    metrics_interval_ms: float = _opt(500.0, "how often gauges are sampled and batched metric updates flushed")

    def validate(self) -> None:
        if self.response_threads < 1:
            raise ValueError(f"parameter 'response_threads' must be >= 1, got {self.response_threads}")
        if self.cancel_poll_ms <= 0:
            raise ValueError(f"parameter 'cancel_poll_ms' must be > 0, got {self.cancel_poll_ms}")
        if self.metrics_interval_ms <= 0:
            raise ValueError(f"parameter 'metrics_interval_ms' must be > 0, got {self.metrics_interval_ms}")


def _convert(name: str, text: str, annotation: Any) -> Any:
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, annotation = len(args) < len(typing.get_args(annotation)), args[0]
    text = text.strip()
    if optional and text.lower() in ("", "none"):
        return None
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if text not in choices:
            raise ValueError(f"parameter '{name}' must be one of {', '.join(choices)}, got {text!r}")
        return text
    if annotation is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"parameter '{name}' must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    try:
        return annotation(text)
    except ValueError:
        raise ValueError(f"parameter '{name}' must be {annotation.__name__}, got {text!r}") from None


def _fill(cls: type, values: dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values and values[f.name].strip() != "":
            kwargs[f.name] = _convert(f.name, values[f.name], hints[f.name])
    return cls(**kwargs)


def options_from_model_config(model_config: dict[str, Any]) -> tuple[EngineConfig, BackendOptions]:
    """Read the parameters of a model config (the JSON Triton passes to ``initialize``)."""
    values = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
    known = set(EngineConfig.option_names()) | {f.name for f in dataclasses.fields(BackendOptions)}
    unknown = sorted(k for k in values if k not in known and not k.isupper())
    if unknown:
        raise ValueError(f"unknown parameter(s) in config.pbtxt: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    engine: EngineConfig = _fill(EngineConfig, values)
    backend: BackendOptions = _fill(BackendOptions, values)
    engine.validate()
    backend.validate()
    return engine, backend


def to_parameters(engine: EngineConfig, backend: BackendOptions | None = None) -> dict[str, str]:
    """The parameters that ``options_from_model_config`` reads back as these options."""
    values: dict[str, str] = {}
    for obj in (engine, backend or BackendOptions()):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            values[f.name] = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return values

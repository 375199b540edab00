"""config.pbtxt ``parameters`` <-> engine and backend options.

Every ``EngineConfig`` field is a parameter of the same name (``max_running_requests``); an empty
string means the field's default. ``BackendOptions`` are the serving layer's own knobs. Parameters
in capitals belong to Triton or its Python backend (``EXECUTION_ENV_PATH``) and are left alone,
except the vLLM backend's ``REPORT_CUSTOM_METRICS``, which sets ``report_metrics``;
any other unknown name fails the model load, so a typo cannot pass silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from freetoken.config import EngineConfig
from freetoken.fields import field_types, option, parse_text, to_text


@dataclass
class BackendOptions:
    response_threads: int = option(2, "threads that send responses; each owns a share of the requests")
    cancel_poll_ms: float = option(100.0, "how often each response thread asks Triton whether its requests were cancelled")
    report_metrics: bool = option(True, "publish the vllm:* and freetoken_* metric families on Triton's metrics port "
                                        "(the vLLM backend's REPORT_CUSTOM_METRICS parameter, when set, decides)")
    metrics_interval_ms: float = option(500.0, "how often the gauges are sampled (counters and histograms follow each "
                                              "request within ~10 ms)")

    def validate(self) -> None:
        if self.response_threads < 1:
            raise ValueError(f"parameter 'response_threads' must be >= 1, got {self.response_threads}")
        if self.cancel_poll_ms <= 0:
            raise ValueError(f"parameter 'cancel_poll_ms' must be > 0, got {self.cancel_poll_ms}")
        if self.metrics_interval_ms <= 0:
            raise ValueError(f"parameter 'metrics_interval_ms' must be > 0, got {self.metrics_interval_ms}")


def _fill(cls: type, values: dict[str, str]) -> Any:
    """``cls`` from the parameters among ``values`` that name its fields (empty: the default)."""
    kwargs = {}
    for name, kind in field_types(cls).items():
        if name in values and values[name].strip() != "":
            try:
                kwargs[name] = parse_text(values[name], kind)
            except ValueError as exc:
                raise ValueError(f"parameter '{name}' {exc}") from None
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
    custom_metrics = values.get("REPORT_CUSTOM_METRICS", "").strip()
    if custom_metrics:  # a vLLM-backend config.pbtxt works unchanged
        try:
            backend.report_metrics = parse_text(custom_metrics, field_types(BackendOptions)["report_metrics"])
        except ValueError as exc:
            raise ValueError(f"parameter 'REPORT_CUSTOM_METRICS' {exc}") from None
    engine.validate()
    backend.validate()
    return engine, backend


def to_parameters(engine: EngineConfig, backend: BackendOptions | None = None) -> dict[str, str]:
    """The parameters that ``options_from_model_config`` reads back as these options."""
    values: dict[str, str] = {}
    for obj in (engine, backend or BackendOptions()):
        for f in dataclasses.fields(obj):
            values[f.name] = to_text(getattr(obj, f.name))
    return values

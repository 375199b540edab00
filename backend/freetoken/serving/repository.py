"""The model repository ``freetoken serve`` writes: the template with the options as config.pbtxt parameters."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
from pathlib import Path

from freetoken.config import EngineConfig
from freetoken.fields import from_namespace
from freetoken.serving.options import BackendOptions, to_parameters

logger = logging.getLogger("freetoken.serve")

MODEL_DIR_NAME = "freetoken"  # the template's folder in the model repository


def template_dir() -> Path:
    """The model_repository/freetoken template: shipped as package data, or the source checkout's."""
    packaged = Path(__file__).resolve().parent / "model_repository" / MODEL_DIR_NAME
    if (packaged / "config.pbtxt").exists():
        return packaged
    checkout = Path(__file__).resolve().parents[3] / "model_repository" / MODEL_DIR_NAME
    if (checkout / "config.pbtxt").exists():
        return checkout
    raise FileNotFoundError("the model repository template (model_repository/freetoken) is missing")


def write_model_repository(repo: Path, model_name: str, parameters: dict[str, str], template: Path | None = None) -> Path:
    """Copy the template into ``repo/model_name`` with ``parameters`` set in its config.pbtxt."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    template = template or template_dir()
    config = text_format.Parse((template / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.name = model_name
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    target = repo / model_name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(template, target, ignore=shutil.ignore_patterns("__pycache__", "config.pbtxt"))
    header = "# Written by `freetoken serve` from model_repository/freetoken/config.pbtxt.\n"
    (target / "config.pbtxt").write_text(header + text_format.MessageToString(config))
    return target


def engine_parameters(config: EngineConfig, args: argparse.Namespace) -> dict[str, str]:
    """The config.pbtxt parameters of ``config`` and the serving flags in ``args``."""
    options = from_namespace(BackendOptions, args)
    options.validate()
    return to_parameters(config, options)


def resolve_model(config: EngineConfig) -> EngineConfig:
    """Absolute paths (the stub runs elsewhere); the demo model built here when none is given."""
    if config.model is None:
        from freetoken.demo import ensure_demo_model

        config = dataclasses.replace(config, model=str(ensure_demo_model()))
        logger.info("no --model given: serving the embedded demo model at %s", config.model)
    elif not Path(config.model).is_dir():
        raise FileNotFoundError(f"--model {config.model}: no such directory")
    config = dataclasses.replace(config, model=str(Path(config.model).resolve()))
    if config.tokenizer:
        config = dataclasses.replace(config, tokenizer=str(Path(config.tokenizer).resolve()))
    return config


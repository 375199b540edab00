"""The flags of ``freetoken serve`` beyond the engine's: the server's, and one per ``BackendOptions`` field.

No torch or numpy is imported, so ``freetoken --help`` stays fast.
"""

from __future__ import annotations

import argparse

from freetoken.fields import add_flags
from freetoken.serving.options import BackendOptions


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--model-name", default="freetoken", help="name clients use in URLs (default: freetoken)")
    group.add_argument("--host", default="0.0.0.0", help="address the HTTP, gRPC and metrics ports bind (default: 0.0.0.0)")
    group.add_argument("--http-port", type=int, default=8000, help="HTTP/REST port (default: 8000)")
    group.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default: 8001)")
    group.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default: 8002)")
    group.add_argument("--tritonserver", default=None,
                       help="the tritonserver binary (default: $FREETOKEN_TRITONSERVER, then PATH, then the nvidia-pytriton wheel's)")
    group.add_argument("--backend-directory", default=None,
                       help="Triton backends directory for a given tritonserver (default: $FREETOKEN_TRITON_BACKEND_DIR, "
                            "$TRITON_BACKEND_DIR, else the server's own)")
    group.add_argument("--stub-python", default=None,
                       help="interpreter whose packages the Python backend stub uses (default: $FREETOKEN_STUB_PYTHON, "
                            "else this one); it needs freetoken and numpy<2")
    group.add_argument("--model-repository", default=None,
                       help="where to write the model repository (default: a temporary directory, removed at exit)")
    group.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level (default: 0)")
    group.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the model to load before giving up (default: 900)")
    group.add_argument("--stop-timeout", type=float, default=30.0,
                       help="seconds a stopping server gets before its processes are killed (default: 30)")
    group.add_argument("--tritonserver-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for tritonserver (repeatable), e.g. --tritonserver-arg=--log-info=false "
                            "(default: none)")
    add_flags(parser.add_argument_group("serving (config.pbtxt parameters)"), BackendOptions)

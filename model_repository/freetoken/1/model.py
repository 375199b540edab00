"""Triton Python backend entry point of FreeToken: a thin shell over ``freetoken.serving``.

The engine runs in its own thread inside this stub process; ``execute`` only validates and
enqueues (decoupled transaction policy), and response threads send every result through each
request's response sender. docs/serving.md documents the protocol and the parameters.
"""

import json

import triton_python_backend_utils as pb_utils

from freetoken.serving.backend import TritonBackend
from freetoken.serving.logs import install_log_handler


class TritonPythonModel:
    def initialize(self, args):
        install_log_handler(pb_utils)
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("FreeToken needs model_transaction_policy { decoupled: true } in config.pbtxt")
        self.backend = TritonBackend(pb_utils, model_config, args["model_name"], args["model_version"])

    def execute(self, requests):
        self.backend.execute(requests)
        return None

    def finalize(self):
        self.backend.finalize()

"""Test-only model.py: FreeToken's, with a fault injected so that its engine thread dies.

A request whose prompt is exactly ``DEATH_IDS`` makes the scheduler raise outside the engine's
per-step error handling, which kills the engine loop: the path a real fatal bug would take.
"""

import json

import triton_python_backend_utils as pb_utils

from freetoken.serving.backend import TritonBackend
from freetoken.serving.logs import install_log_handler

DEATH_IDS = [3, 1, 4, 1, 5, 9, 2, 6]


class TritonPythonModel:
    def initialize(self, args):
        install_log_handler(pb_utils)
        self.backend = TritonBackend(pb_utils, json.loads(args["model_config"]), args["model_name"], args["model_version"])
        scheduler = self.backend.runtime.scheduler
        schedule = scheduler.schedule

        def schedule_or_die():
            if any(req.prompt_token_ids == DEATH_IDS for req in scheduler.waiting):
                raise RuntimeError("injected engine failure")
            return schedule()

        scheduler.schedule = schedule_or_die

    def execute(self, requests):
        self.backend.execute(requests)
        return None

    def finalize(self):
        self.backend.finalize()

"""Each Triton kernel against its torch reference, at small odd sizes.

Without CUDA the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set here before
any kernel module is imported); with CUDA they run compiled on the GPU. Every buffer the kernel
wrappers allocate is poisoned (NaN / -1) so elements a kernel leaves unwritten fail the checks.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

COMPILE_CHECK_ARCH = os.environ.get("FREETOKEN_COMPILE_CHECK")  # e.g. "90": see compile_only.py
if COMPILE_CHECK_ARCH:
    import compile_only

    compile_only.install(int(COMPILE_CHECK_ARCH))
    pytest_runtest_makereport = compile_only.pytest_runtest_makereport
    pytest_terminal_summary = compile_only.pytest_terminal_summary
    # The engine would switch the kernels to the interpreter (for every module imported after it).
    collect_ignore = ["test_engine_triton.py", "test_engine_triton_nvfp4.py", "test_expert_offload_triton.py",
                      "test_prefix_snapshots_triton.py", "test_prefill_graphs_triton.py"]
elif not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a kernel is decorated: a kernel module imported before this
    # point (a test module of another folder importing one at collection) would stay compiled, and
    # every interpreted test here would fail far from the cause. Name the cause instead.
    _early = sorted(m for m in sys.modules if m.startswith("freetoken.kernels.triton."))
    if _early:
        raise pytest.UsageError(
            f"{', '.join(_early)} imported before tests/kernels turned Triton's interpreter on: a test "
            "module collected earlier imports a Triton kernel module at module level; import it inside "
            "the test instead"
        )
    os.environ["TRITON_INTERPRET"] = "1"

from kernel_checks import poisoned_outputs  # noqa: E402, F401  (autouse)


@pytest.fixture
def rng() -> torch.Generator:
    """Fresh random inputs each run (the seed is printed on failure through the test id)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))

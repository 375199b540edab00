"""Compile every kernel for a GPU target on a machine without one: a CPU-side check of what only
compiled Triton rejects (type rules, constexpr rules, shared memory) that the interpreter accepts.

``FREETOKEN_COMPILE_CHECK=90 pytest tests/kernels`` runs the kernel tests with a stand-in driver
that reports an sm_90 device: each launch compiles its kernel down to a cubin (Triton ships
ptxas) and launches nothing. A test passes unless a compile failed in it, since nothing computed
the outputs it checks. Pin the Triton version of the GPU host (e.g. 3.6) to check against it.
"""

from __future__ import annotations

import pytest

compile_errors: list[BaseException] = []
compiled: set[str] = set()


class _CompileOnlyDriver:
    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


def install(arch: int) -> None:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_CompileOnlyDriver(arch))
    original_run = JITFunction.run

    def compile_only_run(self, *args, grid, warmup, **kwargs):
        try:
            kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:
            compile_errors.append(exc)
            raise
        compiled.add(self.fn.__name__)
        return kernel

    JITFunction.run = compile_only_run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    if compile_errors:
        report.outcome = "failed"
        report.longrepr = f"compile error: {compile_errors[-1]}"
        compile_errors.clear()
    elif report.outcome == "failed":
        report.outcome = "passed"  # outputs were never computed: only compilation is checked


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"compile-only check: {len(compiled)} kernels compiled: {sorted(compiled)}")

"""Compile every kernel for a GPU target on a machine without one: a CPU-side check of what only
compiled Triton rejects (type rules, constexpr rules, shared memory) that the interpreter accepts.

``FREETOKEN_COMPILE_CHECK=90 pytest tests/kernels`` runs the kernel tests with a stand-in driver
that reports an sm_90 device: each launch compiles its kernel down to a cubin (Triton ships
ptxas) and launches nothing. A test passes unless a compile failed in it, since nothing computed
the outputs it checks. Pin the Triton version of the GPU host (e.g. 3.6) to check against it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

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


def resources_and_sass(kernel) -> tuple[str, str]:
    """A compiled kernel's ``cuobjdump --dump-resource-usage`` line (REG, STACK, SHARED, LOCAL) and
    its SASS, from the cuobjdump Triton ships (for the benchmarks that read what a kernel became)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    line = next((l.strip().split("CONSTANT")[0] for l in usage.splitlines() if "REG:" in l), usage[:200])
    return line, sass


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

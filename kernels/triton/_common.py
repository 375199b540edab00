"""Helpers shared by the Triton kernels: launch-size arithmetic and dtype-dependent dot precision."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``max(n, floor)`` (block sizes must be powers of two)."""
    return max(triton.next_power_of_2(max(int(n), 1)), floor)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for float32 operands: exact ``ieee`` in float32 runs (so they match
    the float32 reference), TF32 when the model runs in bf16/fp16 (its error is below theirs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def rows_per_program(num_rows: int, block_cols: int) -> int:
    """Rows one program of a row-wise kernel handles: tiles of about 2K elements on the GPU (one
    row of a wide tensor, several of a narrow one); under the interpreter, whose cost is per
    program and per operation, tiles of up to 16K elements."""
    budget = (16384 if INTERPRETED else 2048) // block_cols
    return max(1, min(pow2(num_rows), budget, 64))


# Tests set this to fill every buffer the wrappers allocate (outputs and intermediates) with NaN
# (floats) or -1 (integers), so an element a kernel forgot to write, or a read of one never written,
# fails the comparison instead of passing on stale memory.
poison_outputs = False


def new_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, poisoned when :data:`poison_outputs` is set."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if poison_outputs:
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


_INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETED)


def device_function(fn):
    """``triton.jit`` for a helper called from kernels. Under the interpreter the helper stays a
    plain Python function: the interpreter re-patches ``triton.language`` on every call of a jitted
    helper, which made helper-heavy kernels many times slower there."""
    return fn if _INTERPRETED else triton.jit(fn)


# Triton's interpreter converts float32 to bf16 by truncation; kernels round through ``cast``, which
# rounds to nearest-even explicitly there (the GPU's conversion already does).
@device_function
def cast(x, dtype: tl.constexpr):
    """float32 ``x`` converted to ``dtype`` with round-to-nearest-even, also under the interpreter."""
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@device_function
def round_as(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype``'s precision, kept in float32 (where a reference rounds)."""
    return cast(x, dtype).to(tl.float32)


@device_function
def dot(a, b, precision: tl.constexpr):
    """``tl.dot`` accumulating in float32. The interpreter multiplies bf16 operands as raw integers,
    so there they are widened to float32 first."""
    if _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=precision)


# Zeroed int32 counters per (device, owner): a launch whose programs count their arrivals
# (``arrive``) leaves its counters zero again, so they need no memset per launch or graph replay.
_counter_buffers: dict[tuple[torch.device, str], list[torch.Tensor]] = {}


def zeroed_counters(device: torch.device, owner: str, size: int) -> torch.Tensor:
    """``size`` zeroed int32 arrival counters on ``device`` for the kernels of ``owner`` (each
    owner its own buffer: launches of one owner run in stream order, as the engine's do).

    Grown, never shrunk or freed: a captured graph keeps using the buffer it was captured with.
    The engine's eager warm-up runs before each capture allocate the largest buffer first."""
    buffers = _counter_buffers.setdefault((torch.device(device), owner), [])
    if not buffers or buffers[-1].numel() < size:
        buffers.append(torch.zeros(max(pow2(size), 1024), dtype=torch.int32, device=device))
    return buffers[-1]


@device_function
def arrive(counter, members):
    """Whether this program is the last of ``members`` to reach ``counter``; the last resets it.

    The barrier orders every thread's stores before the counter's release; the acquire orders the
    last program's reads of the other programs' stores after it (read them with ``.cg``: L1 may
    hold stale lines)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == members - 1
    if last:
        tl.store(counter, 0)  # every member has arrived: nothing else touches it in this launch
    return last

"""Make Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels on the CPU) usable
when Triton was imported before the variable was set, and fast enough for end-to-end runs.

Two adjustments, applied once when the kernel package is imported under the interpreter:

* Triton's standard library (``tl.sum``, ``tl.sigmoid``, ``tl.cdiv``...) is decorated when
  ``triton.language`` is first imported. If that happened before ``TRITON_INTERPRET=1`` was set
  (torch or transformers import Triton early; ``set_kernel_backend("triton")`` sets the variable
  later), those functions are compiled-kernel helpers that an interpreted kernel cannot call
  ("Cannot call @triton.jit'd outside of the scope of a kernel"). They are re-wrapped as
  interpreted functions, which is what Triton itself creates when the variable is set first.
* The interpreter re-patches ``triton.language`` on every call of a device function (``tl.sum``
  is one), which dominated the run time of small kernels. A launch already patches the language
  for its kernel and the patches of a device function's own modules persist, so each device
  function is patched on its first call only.
* The interpreter checks every 32-bit integer addition and multiplication for overflow (a
  ``device_assert`` per operation, the other large cost). Compiled kernels check nothing unless
  built in debug mode; the interpreter is made to do the same.

Both touch interpreter internals; if they are missing (another Triton version) nothing is changed
and the interpreter runs as shipped.
"""

from __future__ import annotations

import dataclasses
import sys


def prepare_interpreter() -> None:
    try:
        from triton.runtime import interpreter
        from triton.runtime.jit import JITFunction

        interpreted_function = interpreter.InterpretedFunction
        patch_lang = interpreter._patch_lang
        error = interpreter.InterpreterError
    except (ImportError, AttributeError):
        return
    _reinterpret_standard_library(interpreted_function, JITFunction)
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    if getattr(interpreted_function, "_freetoken_fast_calls", False):
        return

    def call(self, *args, **kwargs):
        if not getattr(self, "_freetoken_patched", False):
            patch_lang(self.fn)
            self._freetoken_patched = True
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise error(repr(exc)) from exc

    interpreted_function.__call__ = call
    interpreted_function._freetoken_fast_calls = True


def _reinterpret_standard_library(interpreted_function, jit_function) -> None:
    replaced: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, jit_function):
                if id(value) not in replaced:
                    replaced[id(value)] = interpreted_function(value.fn)
                setattr(module, attr, replaced[id(value)])

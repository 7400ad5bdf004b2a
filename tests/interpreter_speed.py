"""A faster Triton interpreter for the CPU tier (TRITON_INTERPRET=1): what the kernels compute
is unchanged.

- Integer-overflow asserts off (``sanitize_overflow``): the interpreter, unlike a compiled
  kernel without debug, widens every int32 add, sub and mul to int64 and asserts the result
  fits: half of a kernel test's time (test_kernel_norm_ahead: 95 of 186 s under cProfile). The
  CPU tier's shapes are far from int32's limits; the GPU suite runs the real shapes compiled.
- The builtins' names listed once. Triton (3.6) patches triton.language's builtins at every
  call of a @triton.jit helper inside a kernel (``interpreter._patch_lang`` ->
  ``_patch_builtin``), each time listing the package's members with ``inspect.getmembers``
  (dir, sort, getattr of each): a third of a model test's time (test_qkv_rope_model: 72 of
  220 s under cProfile). The names do not change, so they are listed once per package; each
  call still reads every one's current value and patches it only if it is a builtin, as the
  original does.
"""

from __future__ import annotations

import dataclasses
import inspect


def speed_up_interpreter() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    _cache_builtin_scans()


def _cache_builtin_scans() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or getattr(original, "cached_scans", False):
        return
    names: dict[int, tuple[str, ...]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        listed = names.get(id(pkg))
        if listed is None:
            listed = tuple(n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m))
            names[id(pkg)] = listed
        for name in listed:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.cached_scans = True
    interpreter._patch_builtin = patch_builtin

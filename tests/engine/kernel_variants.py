"""Which Triton variants launches would compile, computed on the CPU the way Triton 3.x keys its cache.

`record_variants` swaps the named kernels of a module for recorders: a launch records its key (kernel
name, each constexpr's value, each other argument's type and specialisation as Triton's binder computes
it with the kernel's own `do_not_specialize` list, plus the launch options) and runs nothing. Two
launches with the same key share one compiled kernel on the GPU; a new key is a compile.
"""

from __future__ import annotations

import contextlib
import inspect

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend


def _not_specialized(kernel) -> set:
    names = getattr(kernel, "do_not_specialize", None)  # a JITFunction
    if names is None:  # an InterpretedFunction keeps the decorator's arguments
        names = kernel.kwargs.get("do_not_specialize")
    return set(names or [])


def variant_key(kernel, args: tuple, kwargs: dict) -> tuple:
    signature = inspect.signature(kernel.fn)
    params = {k: v for k, v in kwargs.items() if k in signature.parameters}
    options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in signature.parameters))
    bound = signature.bind(*args, **params)
    bound.apply_defaults()  # Triton binds parameters left at their defaults too (and keys on them)
    skip = _not_specialized(kernel)
    key = []
    for index, (name, param) in enumerate(signature.parameters.items()):
        value = bound.arguments[name]
        if "constexpr" in str(param.annotation):
            key.append((name, value))
        else:
            specialize = name not in skip and index not in skip
            key.append((name, native_specialize_impl(BaseBackend, value, False, specialize, True)))
    return (kernel.fn.__name__, tuple(key), options)


class _Recorder:
    def __init__(self, kernel, keys: list):
        self.kernel = kernel
        self.keys = keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append(variant_key(self.kernel, args, kwargs))

        return launch


@contextlib.contextmanager
def record_variants(monkeypatch, module, names: list[str]):
    """Within the block, launches of `module.<name>` record their keys into the yielded list."""
    keys: list = []
    with monkeypatch.context() as patch:
        for name in names:
            patch.setattr(module, name, _Recorder(getattr(module, name), keys))
        yield keys

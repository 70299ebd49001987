"""Changing vLLM at a seam, and undoing it: the only code that assigns into vLLM's modules.

* ``wrap(seam, make)`` replaces a method (``Class.method`` seams, or ``members`` of a class
  seam) with ``make(original)``; the wrapper carries the one idempotence marker
  ``__vllm_dflash_original__`` (the function it replaced), so a second ``wrap`` of the same
  method is a no-op.
* ``rebind(seam, value)`` sets a module or class attribute.
* Both act once the seam's module is imported (at once if it already is), so the plugin can
  register them before vLLM imports its heavy runner modules.
* ``changed_elsewhere`` records a change made through vLLM's own API (a registry entry).
* ``restore_all()`` puts back every original and drops the pending import hooks: vLLM is as
  it was before the first change.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dflash.serving.seams import SEAMS

MARKER = "__vllm_dflash_original__"

# Undo functions of every change made, in order, with what each changed.
_CHANGED: list[tuple[str, Callable[[], None]]] = []


def _owner_and_name(module: ModuleType, attr: str) -> tuple[Any, str]:
    owner: Any = module
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _set(owner: Any, name: str, value: Any) -> None:
    if name in vars(owner):
        previous = vars(owner)[name]
        undo: Callable[[], None] = lambda: setattr(owner, name, previous)  # noqa: E731
    else:
        undo = lambda: delattr(owner, name)  # noqa: E731
    _CHANGED.append((f"{getattr(owner, '__name__', owner)}.{name}", undo))
    setattr(owner, name, value)


def wrap(seam_name: str, make: Callable[[Callable], Callable], member: str | None = None) -> None:
    s = SEAMS[seam_name]
    attr = s.attr if member is None else f"{s.attr}.{member}"

    def apply(module: ModuleType) -> None:
        owner, name = _owner_and_name(module, attr)
        original = getattr(owner, name)
        if hasattr(original, MARKER):
            return
        wrapper = make(original)
        setattr(wrapper, MARKER, original)
        _set(owner, name, wrapper)

    after_import(s.module, apply)


def rebind(seam_name: str, make_value: Callable[[], Any]) -> None:
    """Set the seam's attribute to ``make_value()``, called once the module is imported
    (our replacements import vLLM modules of their own)."""
    s = SEAMS[seam_name]

    def apply(module: ModuleType) -> None:
        owner, name = _owner_and_name(module, s.attr)
        value = make_value()
        if getattr(owner, name, None) is not value:
            _set(owner, name, value)

    after_import(s.module, apply)


def changed_elsewhere(what: str, undo: Callable[[], None]) -> None:
    """Record a change made through vLLM's own API (a registry entry, a dataclass field),
    so that ``restore_all`` undoes it too."""
    _CHANGED.append((what, undo))


def restore_all() -> None:
    for finder in [f for f in sys.meta_path if isinstance(f, _AfterImport)]:
        sys.meta_path.remove(finder)
    while _CHANGED:
        _, undo = _CHANGED.pop()
        undo()


def changed() -> list[str]:
    """What is changed now, in the order it was changed."""
    return [what for what, _ in _CHANGED]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs each callback with the module once ``name`` has been executed by the normal
    import."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callable[[ModuleType], None]] = []

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib protocol
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # let the regular finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            run(module)
            for callback in self.callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    finders = (f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name)
    finder = next(finders, None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    finder.callbacks.append(callback)

"""Old module paths of canary-jax, kept as aliases of the modules' new homes.

Until 0.1 the contract's modules sat flat in ``canary_jax/`` (``canary_jax.hashing``, ``canary_jax.plans``, ...).
They now live in rooms by job (:mod:`canary_jax.contract`, :mod:`canary_jax.planning`, :mod:`canary_jax.ops`,
:mod:`canary_jax.tools`). Importing an old path returns the *same module object* as the new one (so
``unittest.mock.patch("canary_jax.hashing.fold_words", ...)`` patches what the library calls), and imports
nothing until the old path is asked for. Each old path is deprecated: its first import warns
(``DeprecationWarning``, naming the new path). ``canary_jax.integration`` and ``canary_jax.step_inputs`` (the guard's
first homes, now in :mod:`canary_jax.runtime`) are re-exporting modules in :mod:`canary_jax._compat`.

The finder sits on ``sys.meta_path`` and answers only for the names in :data:`OLD_PATHS` and their submodules
(``canary_jax.faults.plan`` -> ``canary_jax.tools.faults.plan``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

ROOMS = {
    "contract": ("constants", "pairs", "ints", "hashing", "layout", "sources", "coverage", "validation", "decode"),
    "planning": ("plans", "plan_builder", "slot_tables", "slot_reads", "expected_tokens"),
    "ops": ("launch", "reference", "backends", "padding", "buckets"),
    "runtime": ("dump",),
    "tools": ("faults",),
    "_compat": ("integration", "step_inputs"),
}

#: ``{old dotted path: new dotted path}`` for every module that moved.
OLD_PATHS = {f"canary_jax.{m}": f"canary_jax.{room}.{m}" for room, mods in ROOMS.items() for m in mods}
OLD_PATHS["canary_jax.tools.dump"] = "canary_jax.runtime.dump"  # the dump's home until CanaryGuard.dump used it


def new_path(fullname: str) -> str | None:
    """The new home of ``fullname`` if it is an old path or inside one, else None."""
    for old, new in OLD_PATHS.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self._target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def get_code(self, fullname: str):  # ``python -m`` an old path (runpy asks the loader for the code)
        return importlib.util.find_spec(self._target).loader.get_code(self._target)

    def exec_module(self, module: ModuleType) -> None:
        # Already executed under its new name; importlib has just set the alias spec on it: put its own back.
        module.__spec__ = self._spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_path(fullname)
        if new is None:
            return None
        home = "canary_jax.runtime" if new.startswith("canary_jax._compat.") else f"{new} (the same module)"
        warnings.warn(f"{fullname} is deprecated: import {home}", DeprecationWarning, stacklevel=2)
        loader = _AliasLoader(new)
        spec = importlib.machinery.ModuleSpec(fullname, loader)
        real = sys.modules.get(new)
        if real is None:
            try:
                real = importlib.import_module(new)
            except ModuleNotFoundError as e:
                if e.name != new:
                    raise
                return None  # no such module under the new path either: the old name's own error
        if hasattr(real, "__path__"):
            spec.submodule_search_locations = list(real.__path__)
        return spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent; done when this module is imported)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


install()

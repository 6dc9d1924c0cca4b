"""Environment variables that a launch reads on every call, at a dict lookup's cost.

``os.environ.get`` encodes its key and raises and catches a ``KeyError`` for an unset variable: about 2 us per
read on a slow host, and a launch reads three (the torch path, the backend, the graph cap; issue #26 asks a
replayed launch to cost the host at most 15 us). :func:`get` reads the same mapping that ``os.environ`` keeps
(``os.environ[...] = ...``, ``del`` and ``unittest.mock.patch.dict`` all show at once), with the key encoded once.
"""

from __future__ import annotations

import os

_ENVIRON = os.environ
_DATA = getattr(_ENVIRON, "_data", None)  # CPython's backing dict of os.environ (encoded keys and values)
_FAST = isinstance(_DATA, dict) and callable(getattr(_ENVIRON, "encodekey", None))
_KEYS: dict[str, object] = {}
_VALUES: dict[object, str] = {}  # raw value -> decoded (a handful of distinct values in a process)


def get(name: str) -> str | None:
    """``os.environ.get(name)``: the variable's value, or None where it is unset."""
    if not _FAST:
        return _ENVIRON.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENVIRON.encodekey(name)
    raw = _DATA.get(key)
    if raw is None:
        return None
    value = _VALUES.get(raw)
    if value is None:
        value = _ENVIRON.decodevalue(raw)
        if len(_VALUES) < 64:
            _VALUES[raw] = value
    return value

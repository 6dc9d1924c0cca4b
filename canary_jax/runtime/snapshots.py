"""Device-to-host reads of the host-side reporters: a non-blocking snapshot now, a scalar read later.

SGLang pumps its reporters one step late so the device never waits for the host; the reporters of
:mod:`canary_jax.runtime.report`, :mod:`canary_jax.runtime.stats` and :mod:`canary_jax.runtime.health` start a
``copy_to_host_async`` at step ``s`` (:func:`_snapshot`) and read it at step ``s + 1`` (:func:`_first`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _snapshot(x: Any) -> Any:
    """Starts a device-to-host copy (non-blocking) and returns the array to read later."""
    if isinstance(x, jax.Array):
        try:
            x.copy_to_host_async()
        except Exception:  # pragma: no cover - backends without async copies
            pass
    return x


def _first(x: Any) -> int:
    """``x.reshape(-1)[0]`` as a Python int (a device-to-host read when ``x`` is a device array)."""
    return int(np.asarray(x).reshape(-1)[0])

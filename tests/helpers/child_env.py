"""The environment of a test's child Python process (a forced-device run, a demo, a README block)."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with the repository root first on ``PYTHONPATH`` and ``XLA_FLAGS`` without a forced device
    count (the child sets its own); the other XLA flags, such as tests/conftest.py's CPU optimisation level, stay.
    ``extra`` is added last."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env

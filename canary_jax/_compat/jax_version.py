"""The jax versions canary-jax runs on: a jax below the floor is refused at import, naming both versions; and
jax 0.12's lazily registered Pallas flag is registered up front (:func:`register_pallas_flags`).

pip refuses such an install from ``pyproject.toml``'s ``jax>=0.8.3``, but a later ``pip install jax==...`` only
warns, and then nothing would: the floor is the oldest jax the suites run on (sglang-jax 0.0.2 pins
``jax[tpu]~=0.8.0``, which resolves to 0.8.3; ``.ci/run``'s stacks job), and below it nothing is tested.
"""

from __future__ import annotations

import contextlib

import jax

JAX_FLOOR = (0, 8, 3)


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"0.12.0.1"`` -> (0, 12, 0, 1), ``"0.9.0rc1"`` -> (0, 9)."""
    out = []
    for part in version.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def check_jax_version(version: str | None = None) -> None:
    """Refuses a jax older than :data:`JAX_FLOOR`.

    Args:
      version: a jax version string; None reads the installed ``jax.__version__``.

    Raises:
      ImportError: the version is below the floor; the message names it and the floor.
    """
    version = jax.__version__ if version is None else version
    if _release(version) < JAX_FLOOR:
        floor = ".".join(map(str, JAX_FLOOR))
        raise ImportError(
            f"canary-jax needs jax >= {floor} (the oldest release its tests run on), but jax {version} is "
            f"installed: pip install 'jax>={floor}' 'jaxlib>={floor}'"
        )


def register_pallas_flags() -> None:
    """Imports ``jax.experimental.pallas.fuser`` now (absent on some jax versions: nothing to do).

    jax 0.12's Pallas imports it on first use, inside the first trace of a Pallas kernel, and the import registers
    a trace-context flag (``pallas_fuser_disable_nested_fuse``). A serving step jitted before that point, whose
    first trace launches the canary's kernels, then misses its cache on the next call ("tracing context values
    differ" with ``JAX_EXPLAIN_CACHE_MISSES=1``) and compiles a second time. Registered at import, a step compiles
    once. The fuser is jax's own module: canary_jax still imports no kernel package at import time.
    """
    with contextlib.suppress(ImportError):
        import jax.experimental.pallas.fuser  # noqa: F401


check_jax_version()  # on import: canary_jax imports this module before any module that uses jax
register_pallas_flags()

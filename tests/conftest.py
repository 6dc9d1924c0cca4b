"""Test-session settings shared by every test module."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees compiled programs after each module: on XLA:CPU every compiled Pallas program keeps hundreds of
    memory mappings, and one pytest process running every suite would otherwise pass the kernel's
    ``vm.max_map_count`` and crash inside XLA's compiler."""
    yield
    jax.clear_caches()

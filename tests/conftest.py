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


# The files that take longest on a 2-core CI machine (interpreted Pallas compiles, subprocesses), started first:
# pytest-xdist hands whole files to its two workers in collection order (`--dist loadfile`), so a long file
# collected last would run alone at the end while the other worker idles.
SLOW_FIRST = (
    "test_step_safety.py",
    "test_pallas_long_chain.py",
    "test_pallas_units.py",
    "test_serving_step_smoke.py",
    "test_demo.py",
    "test_sharded.py",
    "test_pallas_interpret.py",
    "test_pallas_tpu_interpret.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: files keep their order

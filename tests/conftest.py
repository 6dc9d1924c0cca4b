"""Test-session settings shared by every test module."""

import os
import shutil

import jaxlib.version

# canary_jax's version parsing and floor (importing it starts no backend: XLA reads XLA_FLAGS at the first device use)
from canary_jax._compat.jax_version import JAX_FLOOR, _release

# Without a GPU, XLA:CPU compiles the suite's programs at LLVM optimisation level 0. Most of the suite's time is
# compiling interpreted Pallas kernels, which run a few times each: on the 2-core CI machine the step-safety Pallas
# cases took 188 s instead of 344 s in one back-to-back pair. Integer results do not depend on the optimisation
# level. Set before jax starts its backend; child processes inherit it; a caller's own XLA_FLAGS are kept.
#
# Up to jaxlib 0.10 the suite's programs also compile with XLA:CPU's older loop emitters: in one back-to-back
# comparison (tests/test_pallas_interpret.py's write and verify one-to-four-sources cases, 22 programs, two runs
# each) their backend compile took 10.4 to 11.8 s instead of 14.3 to 14.4 s, and the whole suite (2 workers, 2
# cores) 15:05 instead of 22:03 to 22:25, 28 CPU minutes instead of 42. jaxlib 0.12 has no such flag (XLA
# aborts on a flag it does not know), so it is added only where it was run: jaxlib 0.8.3, 0.9.2 and 0.10.2.
# The version is the imported jaxlib's, not package metadata (which a stale dist-info can shadow).
_CPU_FLAGS = ["--xla_backend_optimization_level=0"]
if JAX_FLOOR <= _release(jaxlib.version.__version__) < (0, 11):
    _CPU_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
if shutil.which("nvidia-smi") is None:
    _flags = os.environ.get("XLA_FLAGS", "")
    _new = [f for f in _CPU_FLAGS if f.split("=")[0] not in _flags]
    os.environ["XLA_FLAGS"] = " ".join([_flags, *_new]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# jax 0.12 registers a Pallas trace-context flag inside the first Pallas trace, after which programs traced before it
# miss their cache once and compile again; canary_jax registers it at import (canary_jax._compat.jax_version), so
# import it before any test traces.
import canary_jax  # noqa: E402, F401


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
SLOW_FIRST = (  # by their worker seconds in one full run (2 workers, 2 cores)
    "test_step_safety.py",
    "test_pallas_tpu_interpret.py",
    "test_pallas_interpret.py",
    "test_pallas_long_chain.py",
    "test_sharded.py",
    "test_pallas_units.py",
    "test_buckets.py",
    "test_adapters_batches.py",  # with its two parts split off (their seconds were its)
    "test_adapters_block_tables.py",
    "test_adapters_engines.py",
    "test_reference_backend.py",
    "test_demo.py",
    "test_serving_step_smoke.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: files keep their order

"""canary-jax refuses a jax below its floor at import, naming both versions (issue #23: versions that coexist)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from canary_jax._compat.jax_version import JAX_FLOOR, check_jax_version

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_floor_is_pyprojects():
    deps = (ROOT / "pyproject.toml").read_text()
    for name in ("jax", "jaxlib"):
        m = re.search(rf'"{name}>=([0-9.]+),', deps)
        assert m, f"pyproject.toml has no {name}>= pin"
        assert tuple(int(p) for p in m.group(1).split(".")) == JAX_FLOOR


@pytest.mark.parametrize("version", ["0.8.3", "0.9.2", "0.10.2", "0.12.0.1", "0.13.0rc1", jax.__version__])
def test_the_floor_and_newer_are_accepted(version):
    check_jax_version(version)


@pytest.mark.parametrize("version", ["0.7.2", "0.8.2", "0.8.0rc1", "0.4.38"])
def test_older_is_refused_naming_both(version):
    with pytest.raises(ImportError) as e:
        check_jax_version(version)
    assert str(e.value).startswith(
        f"canary-jax needs jax >= 0.8.3 (the oldest release its tests run on), but jax {version} "
    )


def test_import_refuses_an_older_jax():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    code = "import jax; jax.__version__ = '0.7.2'; import canary_jax"
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "ImportError: canary-jax needs jax >= 0.8.3 (the oldest release its tests run on), but jax 0.7.2 is "
        "installed: pip install 'jax>=0.8.3' 'jaxlib>=0.8.3'"
    )


def test_a_jitted_step_with_a_pallas_launch_compiles_once():
    """In a fresh process (no conftest), a jitted function whose first trace launches a Pallas kernel compiles once
    over three calls: jax 0.12 registers a trace-context flag inside the first Pallas trace, which made the second
    call miss the cache and compile again until canary_jax registered it at import."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    code = """
import jax, jax.numpy as jnp
import canary_jax as cj
traces = []
plan = cj.VerifyPlan.from_entries(slots=[1, 2, 3], positions=[0, 1, 2], prev_slots=[-1, 1, 2], verify_capacity=8)
@jax.jit
def step(buf, log):
    traces.append(1)
    ctx = cj.VerifyOrWriteContext(canary_buf=buf, kernel_kind=cj.CanaryLaunchTag.HEAD_K_FULL, log=log)
    return cj.verify(ctx, plan, backend="pallas").log
buf, log = jnp.zeros((16, 32), jnp.uint8), cj.ViolationLog.allocate(ring_capacity=8)
for _ in range(3):
    log = step(buf, log)
print(len(traces), step._cache_size(), int(log.kernel_run_counter(0)))
"""
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["1", "1", "3"]

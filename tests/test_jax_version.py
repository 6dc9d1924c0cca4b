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

"""The shared backend suites (``tests/helpers/*_suite.py``) against the Pallas kernels, default configuration with
the multi-launch write for every launch (``tests/test_pallas_write_fused.py`` runs the write suite fused).

On a machine without a GPU (CI) the kernels run with ``interpret=True``; on a GPU they run compiled (and
``tests/test_gpu_pallas.py`` adds the large GPU-only cases).
"""

import dataclasses

from absl.testing import absltest

from canary_jax.ops import backends
from helpers import pipeline_suite, public_suite, verify_suite, write_suite
from pallas_kernels.config import DEFAULT_CONFIG


class PallasBackendTest(
    verify_suite.VerifySuite,
    write_suite.WriteSuite,
    pipeline_suite.PipelineSuite,
    public_suite.PublicEntrySuite,
    absltest.TestCase,
):
    BACKEND = "pallas"
    VERIFY_IMPL = staticmethod(backends.implementation("verify", "pallas"))
    WRITE_IMPL = staticmethod(backends.implementation("write", "pallas"))
    CONFIG = dataclasses.replace(DEFAULT_CONFIG, write_fused_max_tokens=0, write_fused_max_hashed=0)


if __name__ == "__main__":
    absltest.main()

"""The shared backend suites (``tests/helpers/*_suite.py``) against the Pallas kernels, default configuration.

On a machine without a GPU (CI) the kernels run with ``interpret=True``; on a GPU they run compiled (and
``tests/test_gpu_pallas.py`` adds the large GPU-only cases).
"""

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
    CONFIG = DEFAULT_CONFIG


if __name__ == "__main__":
    absltest.main()

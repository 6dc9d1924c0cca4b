"""The shared backend suites (``tests/helpers/*_suite.py``) against the pure-jnp reference implementation."""

from absl.testing import absltest

from canary_jax.ops import backends
from helpers import pipeline_suite, public_suite, verify_suite, write_suite


class ReferenceBackendTest(
    verify_suite.VerifySuite,
    write_suite.WriteSuite,
    pipeline_suite.PipelineSuite,
    public_suite.PublicEntrySuite,
    absltest.TestCase,
):
    BACKEND = "reference"
    VERIFY_IMPL = staticmethod(backends.implementation("verify", "reference"))
    WRITE_IMPL = staticmethod(backends.implementation("write", "reference"))
    CONFIG = None  # the reference takes no configuration


if __name__ == "__main__":
    absltest.main()

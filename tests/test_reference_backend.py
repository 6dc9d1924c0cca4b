"""The shared verify / write suite (``tests/backend_suite.py``) against the pure-jnp reference backend."""

from absl.testing import absltest

import backend_suite


class ReferenceBackendTest(backend_suite.BackendSuite):
    BACKEND = "reference"


if __name__ == "__main__":
    absltest.main()

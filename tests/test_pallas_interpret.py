"""The shared verify / write suite (``tests/backend_suite.py``) against the Pallas kernels.

On a machine without a GPU (CI) the kernels run with ``interpret=True``; on a GPU they run compiled (and
``tests/test_gpu_pallas.py`` adds the large GPU-only cases).
"""

from absl.testing import absltest

import backend_suite


class PallasBackendTest(backend_suite.BackendSuite):
    BACKEND = "pallas"


if __name__ == "__main__":
    absltest.main()

"""The contract's modules moved into rooms (canary_jax.contract / planning / ops / tools); their old flat paths
still import, as the same module objects, so user code and patches written against them keep working."""

import importlib
import pickle
import subprocess
import sys
from unittest import mock

from absl.testing import absltest, parameterized

from canary_jax import _aliases

MOVED = sorted(k for k in _aliases.OLD_PATHS if not k.startswith(("canary_jax.integration", "canary_jax.step_inputs")))


class OldPathsTest(parameterized.TestCase):
    @parameterized.parameters(*MOVED)
    def test_old_path_is_the_new_module(self, old):
        new = _aliases.OLD_PATHS[old]
        mod = importlib.import_module(old)
        self.assertIs(mod, importlib.import_module(new))
        self.assertEqual(mod.__name__, new)
        self.assertEqual(mod.__spec__.name, new)  # importlib's alias spec is not left on the module

    def test_from_import_and_attribute_access(self):
        from canary_jax import hashing, plans  # old spellings
        from canary_jax.contract import hashing as new_hashing
        from canary_jax.planning import plans as new_plans

        self.assertIs(hashing, new_hashing)
        self.assertIs(plans, new_plans)
        self.assertIs(hashing.splitmix64_python, new_hashing.splitmix64_python)

    def test_submodule_of_a_moved_package(self):
        old = importlib.import_module("canary_jax.faults.buffers")
        self.assertIs(old, importlib.import_module("canary_jax.tools.faults.buffers"))
        from canary_jax.faults import flip_kv_bits

        self.assertIs(flip_kv_bits, old.flip_kv_bits)

    def test_patch_through_the_old_path_reaches_the_library(self):
        import canary_jax.contract.layout as layout

        with mock.patch("canary_jax.layout.read_slot", return_value="patched"):
            self.assertEqual(layout.read_slot(None, 0), "patched")
        self.assertNotEqual(layout.read_slot.__module__, "unittest.mock")

    def test_pickles_name_the_new_home(self):
        from canary_jax.plans import VerifyPlan

        self.assertIs(pickle.loads(pickle.dumps(VerifyPlan)), VerifyPlan)
        self.assertEqual(VerifyPlan.__module__, "canary_jax.planning.plans")

    def test_unknown_old_path_still_fails_with_its_own_name(self):
        with self.assertRaises(ModuleNotFoundError) as cm:
            importlib.import_module("canary_jax.faults.no_such_module")
        self.assertIn("no_such_module", str(cm.exception))

    def test_guard_first_homes_reexport(self):
        from canary_jax.integration import CanaryGuard
        from canary_jax.runtime import CanaryCapacities as new_caps
        from canary_jax.runtime import CanaryGuard as new_guard
        from canary_jax.step_inputs import CanaryCapacities

        self.assertIs(CanaryGuard, new_guard)
        self.assertIs(CanaryCapacities, new_caps)

    def test_old_paths_warn_that_they_are_deprecated(self):
        cases = (
            ("canary_jax.hashing", "import canary_jax.contract.hashing (the same module)"),
            ("canary_jax.tools.dump", "import canary_jax.runtime.dump (the same module)"),
            ("canary_jax.integration", "import canary_jax.runtime"),
        )
        for old, hint in cases:
            p = subprocess.run(
                [sys.executable, "-W", "error::DeprecationWarning", "-c", f"import {old}"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            self.assertNotEqual(p.returncode, 0, old)
            self.assertEqual(p.stderr.strip().splitlines()[-1], f"DeprecationWarning: {old} is deprecated: {hint}")
        p = subprocess.run(  # the new homes import without a warning
            [
                sys.executable,
                "-W",
                "error::DeprecationWarning",
                "-c",
                "import canary_jax.runtime.dump, canary_jax.tools",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_old_path_in_a_fresh_interpreter(self):
        # Nothing imported yet: the old path alone must be enough (the finder comes with the package).
        code = "import canary_jax.hashing as h, canary_jax.contract.hashing as n; assert h is n; print(h.__name__)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        self.assertEqual(out.strip(), "canary_jax.contract.hashing")


if __name__ == "__main__":
    absltest.main()

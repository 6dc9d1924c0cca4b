"""canary-jax: SGLang's KV-cache canary for JAX, byte-for-byte compatible.

Public API (see README.md): constants and enums, uint32-pair int64 handling, canary buffer / violation log
layout, real-KV sources, plans, pure-jnp references, the backend-dispatching ``verify`` / ``write`` entry
points, and violation decoding. Importing this package never imports torch or the Pallas kernels.

The package's rooms: :mod:`canary_jax.contract` (bytes and hashes), :mod:`canary_jax.planning` (plans and slot
tables), :mod:`canary_jax.ops` (verify / write, references, backends, padding), :mod:`canary_jax.runtime` (the
serving-step API and ``CanaryGuard``), :mod:`canary_jax.adapters` (stacks' layouts and batches),
:mod:`canary_jax.tools` (fault injection), :mod:`canary_jax.cli` (the command line). The modules' old
flat paths (``canary_jax.hashing``, ...) still import, as aliases (:mod:`canary_jax._aliases`).
"""

from canary_jax import _aliases  # noqa: F401  (installs the old paths' finder)
from canary_jax._compat import jax_version  # noqa: F401  (refuses a jax below the floor, by name)
from canary_jax.contract import constants
from canary_jax.contract.constants import (
    CANARY_CHAIN_ANCHOR,
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
)
from canary_jax.contract.decode import ViolationRecord, decode_violations, format_violation, format_violations
from canary_jax.contract.ints import as_int64_pairs, int64_to_pairs_np, pairs_to_int64_np
from canary_jax.contract.layout import (
    SlotRecord,
    ViolationLog,
    allocate_canary_buffer,
    read_all_slots,
    read_slot,
)
from canary_jax.contract.sources import RealKvSource, SlotChunks, SourceDescriptor, check_real_kv_sources
from canary_jax.ops.backends import resolve_backend
from canary_jax.ops.launch import verify, write
from canary_jax.ops.phase_launch import verify_then_write
from canary_jax.ops.reference import verify_reference, write_reference
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan

__version__ = "0.1.0"

__all__ = [
    "CANARY_CHAIN_ANCHOR",
    "CANARY_SLOT_BYTES",
    "MAX_REAL_KV_SOURCES",
    "CanaryLaunchTag",
    "FailReason",
    "RealKvHashMode",
    "RealKvSource",
    "SlotChunks",
    "SlotRecord",
    "SourceDescriptor",
    "VerifyOrWriteContext",
    "VerifyPlan",
    "ViolationLog",
    "ViolationRecord",
    "WritePlan",
    "allocate_canary_buffer",
    "as_int64_pairs",
    "check_real_kv_sources",
    "constants",
    "decode_violations",
    "format_violation",
    "format_violations",
    "int64_to_pairs_np",
    "pairs_to_int64_np",
    "read_all_slots",
    "read_slot",
    "resolve_backend",
    "verify",
    "verify_reference",
    "verify_then_write",
    "write",
    "write_reference",
]

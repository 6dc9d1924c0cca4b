"""canary-jax: SGLang's KV-cache canary for JAX, byte-for-byte compatible.

Public API (see README.md): constants and enums, uint32-pair int64 handling, canary buffer / violation log
layout, real-KV sources, plans, pure-jnp references, the backend-dispatching ``verify`` / ``write`` entry
points, and violation decoding. Importing this package never imports torch or the Pallas kernels.
"""

from canary_jax import constants
from canary_jax.backends import resolve_backend
from canary_jax.constants import (
    CANARY_CHAIN_ANCHOR,
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
)
from canary_jax.decode import ViolationRecord, decode_violations, format_violation, format_violations
from canary_jax.ints import as_int64_pairs, int64_to_pairs_np, pairs_to_int64_np
from canary_jax.launch import verify, write
from canary_jax.layout import (
    SlotRecord,
    ViolationLog,
    allocate_canary_buffer,
    read_all_slots,
    read_slot,
)
from canary_jax.plans import VerifyOrWriteContext, VerifyPlan, WritePlan
from canary_jax.reference import verify_reference, write_reference
from canary_jax.sources import RealKvSource, SlotChunks, SourceDescriptor, check_real_kv_sources

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
    "write",
    "write_reference",
]

"""Named constants of the KV canary, shared by references, kernels and decoders.

Everything here mirrors SGLang's ``python/sglang/kernels/ops/kv_canary/consts.py`` and
``verify.py`` (newest layout); ``tests/test_constants.py`` pins every value. See SPEC sections 1.1 to 1.5.
"""

from __future__ import annotations

import enum
from typing import Final

# --- chain and padding ------------------------------------------------------------------------------------
CANARY_CHAIN_ANCHOR: Final[int] = 0xC0FFEE1234567890  # uint64; chain heads store splitmix64(anchor)
REQ_POOL_IDX_PADDING: Final[int] = 0  # req_pool row 0 is the CUDA-graph padding row
TOKEN_TO_KV_SLOT_PADDING: Final[int] = 0  # KV slot 0 is the dummy slot of padded tokens

# --- canary slot layout (little-endian int64 fields) ------------------------------------------------------
CANARY_FIELDS_PER_SLOT: Final[int] = 4
CANARY_FIELD_TOKEN: Final[int] = 0
CANARY_FIELD_POSITION: Final[int] = 1
CANARY_FIELD_PREV_HASH: Final[int] = 2
CANARY_FIELD_REAL_KV_HASH: Final[int] = 3
CANARY_SLOT_BYTES: Final[int] = CANARY_FIELDS_PER_SLOT * 8  # 32

# --- violation ring row (8 x int64) ------------------------------------------------------------------------
VIOLATION_FIELDS: Final[int] = 8
VIOLATION_FIELD_KERNEL_KIND: Final[int] = 0
VIOLATION_FIELD_SLOT_IDX: Final[int] = 1
VIOLATION_FIELD_POSITION: Final[int] = 2
VIOLATION_FIELD_STORED_TOKEN: Final[int] = 3
VIOLATION_FIELD_EXPECTED_TOKEN: Final[int] = 4
VIOLATION_FIELD_STORED_CHAIN_HASH: Final[int] = 5
VIOLATION_FIELD_EXPECTED_AUX: Final[int] = 6
VIOLATION_FIELD_FAIL_REASON_BITS: Final[int] = 7
VIOLATION_FIELD_NAMES: Final[tuple[str, ...]] = (
    "kernel_kind",
    "slot_idx",
    "position",
    "stored_token",
    "expected_token",
    "stored_chain_hash",
    "expected_aux",
    "fail_reason_bits",
)
DEFAULT_RING_CAPACITY: Final[int] = 1024  # SGLANG_KV_CANARY_RING_CAPACITY default

# --- real-KV sources -------------------------------------------------------------------------------------
MAX_REAL_KV_SOURCES: Final[int] = 4
REAL_KV_SOURCE_FIELDS_PER_ENTRY: Final[int] = 3  # page_size, num_bytes_per_token, read_bytes
REAL_KV_ALIGN_BYTES: Final[int] = 16
PARTIAL_READ_BYTES: Final[int] = 16  # bytes hashed per source in PARTIAL mode

# --- masks -----------------------------------------------------------------------------------------------
U64_MASK: Final[int] = (1 << 64) - 1
SPLITMIX64_MUL1: Final[int] = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2: Final[int] = 0x94D049BB133111EB


class FailReason(enum.IntFlag):
    """Bits of violation column 7 (SPEC 1.3)."""

    VERIFY_CHAIN_HASH_MISMATCH = 1 << 0
    VERIFY_POSITION_MISMATCH = 1 << 1
    VERIFY_REAL_KV_HASH_MISMATCH = 1 << 2
    WRITE_TOKEN_MISMATCH = 1 << 3
    WRITE_POSITION_MISMATCH = 1 << 4
    VERIFY_TOKEN_MISMATCH = 1 << 5


FAIL_REASON_ALL_BITS: Final[int] = (1 << 6) - 1


class RealKvHashMode(enum.IntEnum):
    """How many bytes of each real-KV source feed the fingerprint (SPEC 1.4)."""

    NONE = 0
    PARTIAL = 1
    ALL = 2

    @classmethod
    def from_name(cls, name: str) -> RealKvHashMode:
        """Parses SGLang's ``--kv-canary-real-data`` value (case-insensitive member name).

        Raises:
          ValueError: for a name that is not none / partial / all.
        """
        try:
            return cls[str(name).upper()]
        except KeyError:
            raise ValueError(f"kv-canary: real_kv_hash_mode must be one of none/partial/all, got {name!r}") from None


class CanaryLaunchTag(enum.IntEnum):
    """One tag per (HEAD | TAIL | SWEEP) x (K | V) x (FULL | SWA) launch; value = counter index."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11

    @property
    def is_sweep(self) -> bool:
        return self.name.startswith("SWEEP_")

    @property
    def is_head(self) -> bool:
        return self.name.startswith("HEAD_")

    @property
    def is_tail(self) -> bool:
        return self.name.startswith("TAIL_")

    @property
    def is_v_half(self) -> bool:
        return "_V_" in self.name

    @property
    def group(self) -> str:
        """``"FULL"`` or ``"SWA"``: the suffix after the last underscore."""
        return self.name.rsplit("_", 1)[1]


NUM_LAUNCH_TAGS: Final[int] = len(CanaryLaunchTag)  # 12, size of the per-tag counter arrays
SWEEP_TAGS: Final[frozenset[int]] = frozenset(int(t) for t in CanaryLaunchTag if t.is_sweep)
HEAD_TAGS: Final[frozenset[int]] = frozenset(int(t) for t in CanaryLaunchTag if t.is_head)
TAIL_TAGS: Final[frozenset[int]] = frozenset(int(t) for t in CanaryLaunchTag if t.is_tail)
V_HALF_TAGS: Final[frozenset[int]] = frozenset(int(t) for t in CanaryLaunchTag if t.is_v_half)

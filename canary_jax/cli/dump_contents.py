"""What a dump holds (``canary-jax verify-dump``): its canary buffers, violation ring and live requests.

The one job here is recognising the arrays of a dump (:mod:`canary_jax.runtime.dump`, or the older forms that
:mod:`canary_jax.cli.verify_dump` lists): the canary buffers with their group kind, half, phase, SWA LUT and
window and real-KV sources, a violation ring and its write index, and the batch metadata (``req_to_token``,
``req_pool_indices``, ``seq_lens``). Nothing here hashes or verifies; :class:`~canary_jax.runtime.dump.DumpError` for
metadata that does not fit together.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from canary_jax.contract import constants, ints
from canary_jax.contract import sources as sources_lib
from canary_jax.runtime import dump as dump_lib
from canary_jax.runtime.dump import DumpError
from canary_jax.runtime.groups import PoolKind

_RING_KEYS = ("ring", "violation_ring")
_INDEX_KEYS = ("write_index", "violation_write_index")
_LEGACY_BUF_KEYS = ("canary_buf", "head_buf", "tail_buf", "k_head", "k_tail", "v_head", "v_tail")


@dataclasses.dataclass
class _Buffer:
    """One canary buffer of the dump and what is known about it."""

    name: str
    array: np.ndarray
    kind: PoolKind
    half: str  # "K" / "V"
    phase: str  # "HEAD" / "TAIL"
    lut: np.ndarray | None  # int64 host LUT of an SWA group
    window: int
    offset: int
    sources: tuple  # the half's real-KV sources (TAIL and SWEEP hash them)

    @property
    def tag(self) -> constants.CanaryLaunchTag:
        return constants.CanaryLaunchTag[f"{self.phase}_{self.half}_{self.kind.name}"]


def _is_ring(a: np.ndarray) -> bool:
    return (
        a.ndim == 2 and a.shape[1] == constants.VIOLATION_FIELDS and a.dtype.kind in "iu" and a.dtype.itemsize == 8
    ) or (
        a.ndim == 3
        and a.shape[1:] == (constants.VIOLATION_FIELDS, 2)
        and a.dtype.itemsize == 4
        and a.dtype.kind in "iu"
    )


def _is_canary_buf(a: np.ndarray) -> bool:
    return a.ndim == 2 and a.dtype == np.uint8 and a.shape[1] >= constants.CANARY_SLOT_BYTES and a.shape[1] % 8 == 0


def _ring_as_int64(a: np.ndarray) -> np.ndarray:
    return ints.pairs_to_int64_np(a) if a.ndim == 3 else a.astype(np.int64)


def _int(data: dict, key: str, default: int) -> int:
    return int(np.asarray(data.get(key, default)).reshape(-1)[0])


def _buffers(data: dict) -> list[_Buffer]:
    """The canary buffers of a dump, new format (groups) or legacy (single FULL group)."""
    out = []
    if dump_lib.VERSION_KEY in data:
        for i in range(_int(data, "num_groups", 0)):
            p = f"g{i}_"
            kind = PoolKind(_int(data, p + "kind", 0))
            lut = data.get(p + "swa_index_lut")
            for half in ("k", "v"):
                srcs = dump_lib.group_sources(data, i, half)
                for phase in ("head", "tail"):
                    name = f"{p}{half}_{phase}"
                    if name in data:
                        out.append(
                            _Buffer(
                                name=name,
                                array=data[name],
                                kind=kind,
                                half=half.upper(),
                                phase=phase.upper(),
                                lut=None if lut is None else np.asarray(lut, np.int64),
                                window=_int(data, p + "swa_window_size", 0),
                                offset=_int(data, p + "kv_token_id_vs_position_offset", 0),
                                sources=srcs if phase == "tail" else (),
                            )
                        )
        return out
    names = [k for k in _LEGACY_BUF_KEYS if k in data]
    if not names and "" in data and _is_canary_buf(data[""]):
        data = {"canary_buf": data[""]}
        names = ["canary_buf"]
    k_buffer = data.get("k_buffer")
    page_size = _int(data, "page_size", 1)
    for name in names:
        phase = "TAIL" if "tail" in name else "HEAD"
        half = "V" if name.startswith("v_") else "K"
        srcs = ()
        if phase == "TAIL" and half == "K" and k_buffer is not None:
            k = np.ascontiguousarray(k_buffer).view(np.uint8).reshape(k_buffer.shape[0], -1)
            nbpt = k.shape[1] // page_size
            srcs = (sources_lib.RealKvSource(tensor=k, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=nbpt),)
        out.append(_Buffer(name, data[name], PoolKind.FULL, half, phase, None, 0, 0, srcs))
    return out


def _infer_write_index(ring: np.ndarray) -> int:
    """Rows up to and including the last row with any non-zero column (a fill-once, zeroed ring)."""
    used = np.nonzero(np.any(ring != 0, axis=1))[0]
    return int(used[-1]) + 1 if used.size else 0


def _meta(data: dict) -> dict | None:
    if not all(k in data for k in ("req_to_token", "req_pool_indices", "seq_lens")):
        return None
    rpi = np.asarray(data["req_pool_indices"], np.int64).reshape(-1)
    lens = np.asarray(data["seq_lens"], np.int64).reshape(-1)
    if rpi.shape != lens.shape:
        raise DumpError(f"req_pool_indices has {rpi.size} entries but seq_lens has {lens.size}")
    return dict(req_to_token=np.asarray(data["req_to_token"], np.int32), rpi=rpi, lens=lens)

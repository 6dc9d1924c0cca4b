"""Canary buffer groups: the HEAD / TAIL buffers and LUT of one pool (SPEC 8.1).

SGLang attaches one :class:`CanaryBufferGroup` per (pool, :class:`PoolKind`): a plain pool gets a FULL group,
an SWA pool a FULL group and an SWA group. Each group holds a HEAD and a TAIL canary buffer per half (K, and
V unless the pool is MLA-style) and, for SWA groups, the full-to-SWA slot LUT.
:mod:`canary_jax.runtime.endpoints` turns a group into its launch endpoints.

A group holds only what the canary owns. The real-KV sources its TAIL and SWEEP launches fingerprint are views
of the live KV pool, so they are an argument of every call that hashes them (``real_kv_sources=`` of
:func:`canary_jax.runtime.step.canary_tail` and :func:`~canary_jax.runtime.step.canary_sweep`), never kept: a
JAX array kept from an earlier step is a snapshot (a stale copy of the pool, and a second pool-sized buffer
kept alive by every step that returns the group).

JAX is functional, so a group is never updated in place: :meth:`CanaryBufferGroup.with_endpoint` returns a new
group (without re-validating, so it is safe on tracers).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax

from canary_jax.contract import constants, ints, layout
from canary_jax.runtime.launch_endpoint import CanaryEndpoint

__all__ = [
    "CanaryBufferGroup",
    "PoolKind",
]


class PoolKind(enum.IntEnum):
    """FULL covers ``[0, prefix)``; SWA covers ``[max(0, prefix - W), prefix)`` (SPEC 8.1)."""

    FULL = 0
    SWA = 1


_BUFFER_NAMES = ("k_head", "k_tail", "v_head", "v_tail")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryBufferGroup:
    """Canary buffers and LUT of one (pool, PoolKind) (SGLang ``CanaryBufferGroup``, without the sources).

    Fields:
      kind: PoolKind.FULL or PoolKind.SWA (static).
      k_head, k_tail: ``uint8[num_slots, slot_stride_bytes]`` HEAD and TAIL canary buffers of the K half
        (SWA groups: SWA-pool slot indices).
      v_head, v_tail: same for the V half, or both None for MLA-style pools (``has_v_half`` False).
      swa_index_lut: ``uint32[full_pool_size + 1, 2]`` (int64 pairs; any lossless int form is accepted and
        converted) full-to-SWA slot mapping, 0 = evicted; None iff ``kind`` is FULL.
      kv_token_id_vs_position_offset: 0 for target pools, +1 for EAGLE-draft pools (static).
      swa_window_size: W used to plan this group (static): 0 for FULL groups, > 0 for SWA groups.

    Registered as a pytree (arrays are leaves; kind, offset and window are static). It holds no KV data.

    Raises:
      ValueError: LUT presence does not match the kind, V buffers half given, bad window, bad buffers.
    """

    kind: PoolKind
    k_head: Any
    k_tail: Any
    v_head: Any = None
    v_tail: Any = None
    swa_index_lut: Any = None
    kv_token_id_vs_position_offset: int = 0
    swa_window_size: int = 0

    def __post_init__(self) -> None:
        kind = PoolKind(int(self.kind))
        object.__setattr__(self, "kind", kind)
        if (self.v_head is None) != (self.v_tail is None):
            raise ValueError("kv-canary: CanaryBufferGroup needs both v_head and v_tail, or neither (MLA)")
        for name in _BUFFER_NAMES:
            buf = getattr(self, name)
            if buf is not None:
                layout.check_canary_buffer(buf, name=name)
        if kind is PoolKind.FULL:
            if self.swa_index_lut is not None:
                raise ValueError("kv-canary: a FULL CanaryBufferGroup must not carry swa_index_lut")
            if int(self.swa_window_size) != 0:
                raise ValueError(
                    f"kv-canary: a FULL CanaryBufferGroup must have swa_window_size 0, got {self.swa_window_size}"
                )
        else:
            if self.swa_index_lut is None:
                raise ValueError("kv-canary: an SWA CanaryBufferGroup requires swa_index_lut")
            if int(self.swa_window_size) <= 0:
                raise ValueError(
                    f"kv-canary: an SWA CanaryBufferGroup needs swa_window_size > 0, got {self.swa_window_size}"
                )
            lut = ints.as_int64_pairs(self.swa_index_lut, name="swa_index_lut", shape=(None,))
            if lut.shape[0] < 1:
                raise ValueError("kv-canary: swa_index_lut must not be empty")
            object.__setattr__(self, "swa_index_lut", lut)

    @classmethod
    def allocate(
        cls,
        *,
        kind: PoolKind = PoolKind.FULL,
        num_slots: int,
        has_v_half: bool = True,
        slot_stride_bytes: int = constants.CANARY_SLOT_BYTES,
        swa_index_lut: Any = None,
        kv_token_id_vs_position_offset: int = 0,
        swa_window_size: int = 0,
    ) -> CanaryBufferGroup:
        """Zeroed HEAD/TAIL buffers (``uint8[num_slots, slot_stride_bytes]``) for each half."""
        mk = lambda: layout.allocate_canary_buffer(num_slots, slot_stride_bytes)  # noqa: E731
        return cls(
            kind=kind,
            k_head=mk(),
            k_tail=mk(),
            v_head=mk() if has_v_half else None,
            v_tail=mk() if has_v_half else None,
            swa_index_lut=swa_index_lut,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            swa_window_size=swa_window_size,
        )

    @property
    def has_v_half(self) -> bool:
        return self.v_head is not None

    def replace(self, **kw) -> CanaryBufferGroup:
        return dataclasses.replace(self, **kw)

    def with_endpoint(self, endpoint: CanaryEndpoint) -> CanaryBufferGroup:
        """The group with ``endpoint.canary_buf`` stored back under ``endpoint.buffer_name``."""
        return _replace_leaves(self, **{endpoint.buffer_name: endpoint.canary_buf})

    def with_buffers(self, **buffers) -> CanaryBufferGroup:
        """The group with some of ``k_head`` / ``k_tail`` / ``v_head`` / ``v_tail`` replaced, unchecked (safe on
        tracers and placeholders)."""
        return _replace_leaves(self, **buffers)


def _group_flatten(g: CanaryBufferGroup):
    children = (
        g.k_head,
        g.k_tail,
        g.v_head,
        g.v_tail,
        g.swa_index_lut,
    )
    return children, (g.kind, int(g.kv_token_id_vs_position_offset), int(g.swa_window_size))


def _group_unflatten(aux, children) -> CanaryBufferGroup:
    obj = object.__new__(CanaryBufferGroup)
    for name, val in zip(("k_head", "k_tail", "v_head", "v_tail"), children[:4]):
        object.__setattr__(obj, name, val)
    object.__setattr__(obj, "swa_index_lut", children[4])
    object.__setattr__(obj, "kind", aux[0])
    object.__setattr__(obj, "kv_token_id_vs_position_offset", aux[1])
    object.__setattr__(obj, "swa_window_size", aux[2])
    return obj


jax.tree_util.register_pytree_node(CanaryBufferGroup, _group_flatten, _group_unflatten)


def _replace_leaves(g: CanaryBufferGroup, **kw) -> CanaryBufferGroup:
    """``dataclasses.replace`` without re-running ``__post_init__`` (safe on tracers)."""
    children, aux = _group_flatten(g)
    names = ("k_head", "k_tail", "v_head", "v_tail", "swa_index_lut")
    children = tuple(kw.get(n, c) for n, c in zip(names, children))
    return _group_unflatten(aux, children)

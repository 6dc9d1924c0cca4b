"""Buffer groups and launch endpoints: who verifies and writes which canary buffer (SPEC 8.1, 8.2).

SGLang attaches one :class:`CanaryBufferGroup` per (pool, PoolKind): a plain pool gets a FULL group, an SWA
pool a FULL group and an SWA group. Each group yields up to six :class:`CanaryEndpoint` (HEAD / TAIL / SWEEP x
K / V; no V half for MLA-style pools), built by :func:`build_endpoints_from_group` (SGLang ``endpoint.py``):

* HEAD -> its own buffer (``k_head`` / ``v_head``) and **no real-KV sources** (head records hash 0);
* TAIL -> ``k_tail`` / ``v_tail`` with the group's real-KV sources of that half;
* SWEEP -> **shares** the TAIL buffer and TAIL sources of the same half;
* the LUT is the group's ``swa_index_lut`` for SWA groups, None for FULL.

JAX is functional, so an endpoint is a *view* of a group at one moment: a launch returns the updated endpoint
(new ``canary_buf``) and the new :class:`~canary_jax.layout.ViolationLog`, and
:meth:`CanaryBufferGroup.with_endpoint` writes the buffer back under the endpoint's ``buffer_name``. Counters
need no views: the log holds the per-tag arrays and each launch bumps ``[tag]``. All endpoints of a manager
share one log.

:func:`dispatch` routes any endpoint to the launch its tag allows (``launch_sweep`` for SWEEP tags,
``launch_per_forward`` otherwise); :func:`launch_group` runs a whole phase of a group that way.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterable, Sequence

import jax

from canary_jax import constants
from canary_jax import ints
from canary_jax import launch
from canary_jax import layout
from canary_jax.plan_builder import swa_translate
from canary_jax.plans import VerifyOrWriteContext, VerifyPlan, WritePlan

__all__ = [
    "CanaryBufferGroup",
    "CanaryEndpoint",
    "ExpectedInputs",
    "PoolKind",
    "build_endpoints_from_group",
    "dispatch",
    "launch_group",
    "select_endpoints",
]


class PoolKind(enum.IntEnum):
    """FULL covers ``[0, prefix)``; SWA covers ``[max(0, prefix - W), prefix)`` (SPEC 8.1)."""

    FULL = 0
    SWA = 1


_BUFFER_NAMES = ("k_head", "k_tail", "v_head", "v_tail")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedInputs:
    """Expected per-token inputs for the write-input assert (SGLang ``ExpectedInputs``), pre-sliced to T.

    Fields:
      tokens: int64-valued ``[T]`` expected input ids.
      positions: int64-valued ``[T]`` expected positions.
    """

    tokens: Any
    positions: Any


jax.tree_util.register_dataclass(ExpectedInputs, data_fields=["tokens", "positions"], meta_fields=[])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryBufferGroup:
    """Canary buffers, real-KV sources and LUT of one (pool, PoolKind) (SGLang ``CanaryBufferGroup``).

    Fields:
      kind: PoolKind.FULL or PoolKind.SWA (static).
      k_head, k_tail: ``uint8[num_slots, slot_stride_bytes]`` HEAD and TAIL canary buffers of the K half
        (SWA groups: SWA-pool slot indices).
      v_head, v_tail: same for the V half, or both None for MLA-style pools (``has_v_half`` False).
      real_kv_sources_k, real_kv_sources_v: 0..4 :class:`~canary_jax.sources.RealKvSource` per half, read by
        TAIL and SWEEP launches; their tensors are views of the live KV pool (layer 0 in SGLang).
      swa_index_lut: ``uint32[full_pool_size + 1, 2]`` (int64 pairs; any lossless int form is accepted and
        converted) full-to-SWA slot mapping, 0 = evicted; None iff ``kind`` is FULL.
      kv_token_id_vs_position_offset: 0 for target pools, +1 for EAGLE-draft pools (static).
      swa_window_size: W used to plan this group (static): 0 for FULL groups, > 0 for SWA groups.

    Registered as a pytree (arrays and sources are leaves; kind, offset and window are static).

    Raises:
      ValueError: LUT presence does not match the kind, V buffers half given, bad window, bad buffers.
    """

    kind: PoolKind
    k_head: Any
    k_tail: Any
    v_head: Any = None
    v_tail: Any = None
    real_kv_sources_k: tuple = ()
    real_kv_sources_v: tuple = ()
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
        object.__setattr__(self, "real_kv_sources_k", tuple(self.real_kv_sources_k))
        object.__setattr__(self, "real_kv_sources_v", tuple(self.real_kv_sources_v))
        if self.v_head is None and self.real_kv_sources_v:
            raise ValueError("kv-canary: real_kv_sources_v given for a group without a V half")

    @classmethod
    def allocate(
        cls,
        *,
        kind: PoolKind = PoolKind.FULL,
        num_slots: int,
        has_v_half: bool = True,
        slot_stride_bytes: int = constants.CANARY_SLOT_BYTES,
        real_kv_sources_k: Sequence = (),
        real_kv_sources_v: Sequence = (),
        swa_index_lut: Any = None,
        kv_token_id_vs_position_offset: int = 0,
        swa_window_size: int = 0,
    ) -> "CanaryBufferGroup":
        """Zeroed HEAD/TAIL buffers (``uint8[num_slots, slot_stride_bytes]``) for each half."""
        mk = lambda: layout.allocate_canary_buffer(num_slots, slot_stride_bytes)  # noqa: E731
        return cls(
            kind=kind,
            k_head=mk(),
            k_tail=mk(),
            v_head=mk() if has_v_half else None,
            v_tail=mk() if has_v_half else None,
            real_kv_sources_k=tuple(real_kv_sources_k),
            real_kv_sources_v=tuple(real_kv_sources_v),
            swa_index_lut=swa_index_lut,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            swa_window_size=swa_window_size,
        )

    @property
    def has_v_half(self) -> bool:
        return self.v_head is not None

    def replace(self, **kw) -> "CanaryBufferGroup":
        return dataclasses.replace(self, **kw)

    def with_endpoint(self, endpoint: "CanaryEndpoint") -> "CanaryBufferGroup":
        """The group with ``endpoint.canary_buf`` stored back under ``endpoint.buffer_name``."""
        return _replace_leaves(self, **{endpoint.buffer_name: endpoint.canary_buf})

    def with_real_kv_sources(self, sources_k: Sequence | None = None,
                             sources_v: Sequence | None = None) -> "CanaryBufferGroup":
        """The group with new real-KV sources (e.g. views of the KV pool after the model's write)."""
        kw = {}
        if sources_k is not None:
            kw["real_kv_sources_k"] = tuple(sources_k)
        if sources_v is not None:
            kw["real_kv_sources_v"] = tuple(sources_v)
        return _replace_leaves(self, **kw)


def _group_flatten(g: CanaryBufferGroup):
    children = (g.k_head, g.k_tail, g.v_head, g.v_tail, tuple(g.real_kv_sources_k), tuple(g.real_kv_sources_v),
                g.swa_index_lut)
    return children, (g.kind, int(g.kv_token_id_vs_position_offset), int(g.swa_window_size))


def _group_unflatten(aux, children) -> CanaryBufferGroup:
    obj = object.__new__(CanaryBufferGroup)
    for name, val in zip(("k_head", "k_tail", "v_head", "v_tail"), children[:4]):
        object.__setattr__(obj, name, val)
    object.__setattr__(obj, "real_kv_sources_k", tuple(children[4]))
    object.__setattr__(obj, "real_kv_sources_v", tuple(children[5]))
    object.__setattr__(obj, "swa_index_lut", children[6])
    object.__setattr__(obj, "kind", aux[0])
    object.__setattr__(obj, "kv_token_id_vs_position_offset", aux[1])
    object.__setattr__(obj, "swa_window_size", aux[2])
    return obj


jax.tree_util.register_pytree_node(CanaryBufferGroup, _group_flatten, _group_unflatten)


def _replace_leaves(g: CanaryBufferGroup, **kw) -> CanaryBufferGroup:
    """``dataclasses.replace`` without re-running ``__post_init__`` (safe on tracers)."""
    children, aux = _group_flatten(g)
    names = ("k_head", "k_tail", "v_head", "v_tail", "real_kv_sources_k", "real_kv_sources_v", "swa_index_lut")
    children = tuple(kw.get(n, c) for n, c in zip(names, children))
    return _group_unflatten(aux, children)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryEndpoint:
    """One launch unit: a tag, its canary buffer, LUT and real-KV sources (SGLang ``CanaryEndpoint``).

    Fields:
      kernel_kind: the CanaryLaunchTag (stamped in column 0, indexes the counters).
      canary_buf: ``uint8[num_slots, slot_stride_bytes]`` this endpoint verifies / writes.
      full_to_swa_index_mapping: ``uint32[L, 2]`` LUT for SWA endpoints, None for FULL.
      real_kv_sources: 0..4 RealKvSource (empty for HEAD).
      buffer_name: which group buffer ``canary_buf`` is (``k_head`` / ``k_tail`` / ``v_head`` / ``v_tail``).
    """

    kernel_kind: constants.CanaryLaunchTag
    canary_buf: Any
    full_to_swa_index_mapping: Any
    real_kv_sources: tuple
    buffer_name: str

    @property
    def is_sweep(self) -> bool:
        return constants.CanaryLaunchTag(int(self.kernel_kind)).is_sweep

    def _context(self, log: layout.ViolationLog, mode) -> VerifyOrWriteContext:
        return VerifyOrWriteContext(canary_buf=self.canary_buf, kernel_kind=constants.CanaryLaunchTag(int(self.kernel_kind)),
                                    log=log, real_kv_sources=tuple(self.real_kv_sources),
                                    real_kv_hash_mode=constants.RealKvHashMode(int(mode)))

    def launch_per_forward(
        self,
        *,
        verify_plan: VerifyPlan,
        write_plan: WritePlan,
        input_ids: Any,
        positions: Any,
        out_cache_loc: Any,
        violation_log: layout.ViolationLog,
        enable_write_input_assert: bool = False,
        enable_verify_token_assert: bool = False,
        expected_inputs: ExpectedInputs | None = None,
        real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
        backend: str | None = None,
    ) -> tuple["CanaryEndpoint", layout.ViolationLog]:
        """HEAD / TAIL launch: verify ``verify_plan``, then write the step's tokens (SPEC 8.2).

        (1) verify with the token check iff ``enable_verify_token_assert``; (2) SWA endpoints translate
        ``out_cache_loc`` through the LUT (negative stays negative = write skip; a slot past the LUT clamps
        to its last entry, never reading outside it); (3) write, with the expected tensors only when
        ``enable_write_input_assert``.

        Args:
          input_ids, positions, out_cache_loc: int64-valued ``[T]`` ForwardBatch arrays (out_cache_loc in
            full-pool slots; padding tokens after the real rows).
          expected_inputs: required iff ``enable_write_input_assert``.

        Returns:
          ``(endpoint with the new canary_buf, new violation log)``.

        Raises:
          NotImplementedError: on a SWEEP endpoint ("kv-canary: launch_per_forward not supported on sweep
            endpoint SWEEP_K_FULL").
          ValueError: expected inputs missing while the write assert is on; any launch check.
        """
        tag = constants.CanaryLaunchTag(int(self.kernel_kind))
        if tag.is_sweep:
            raise NotImplementedError(f"kv-canary: launch_per_forward not supported on sweep endpoint {tag.name}")
        if enable_write_input_assert and expected_inputs is None:
            raise ValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
        ctx = launch.verify(self._context(violation_log, real_kv_hash_mode), verify_plan,
                            check_verify_expected_token=bool(enable_verify_token_assert), backend=backend)
        loc = out_cache_loc
        if self.full_to_swa_index_mapping is not None:
            loc = swa_translate(ints.as_int64_pairs(out_cache_loc, name="out_cache_loc", shape=(None,)),
                                self.full_to_swa_index_mapping)
        if enable_write_input_assert:
            et, ep = expected_inputs.tokens, expected_inputs.positions
        else:
            et = ep = None
        ctx = launch.write(ctx, write_plan, input_ids, positions, loc,
                           enable_write_input_assert=bool(enable_write_input_assert),
                           expected_input_tokens=et, expected_input_positions=ep, backend=backend)
        return dataclasses.replace(self, canary_buf=ctx.canary_buf), ctx.log

    def launch_sweep(
        self,
        *,
        verify_plan: VerifyPlan,
        violation_log: layout.ViolationLog,
        real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
        backend: str | None = None,
    ) -> layout.ViolationLog:
        """SWEEP launch: verify only, token check off; the buffer is read-only.

        Raises:
          NotImplementedError: on a HEAD / TAIL endpoint ("kv-canary: launch_sweep not supported on
            non-sweep endpoint HEAD_K_FULL").
        """
        tag = constants.CanaryLaunchTag(int(self.kernel_kind))
        if not tag.is_sweep:
            raise NotImplementedError(f"kv-canary: launch_sweep not supported on non-sweep endpoint {tag.name}")
        ctx = launch.verify(self._context(violation_log, real_kv_hash_mode), verify_plan,
                            check_verify_expected_token=False, backend=backend)
        return ctx.log


jax.tree_util.register_pytree_node(
    CanaryEndpoint,
    lambda e: ((e.canary_buf, e.full_to_swa_index_mapping, tuple(e.real_kv_sources)),
               (constants.CanaryLaunchTag(int(e.kernel_kind)), e.buffer_name)),
    lambda aux, ch: CanaryEndpoint(kernel_kind=aux[0], canary_buf=ch[0], full_to_swa_index_mapping=ch[1],
                                   real_kv_sources=tuple(ch[2]), buffer_name=aux[1]),
)

# Per group, its tags in SGLang's endpoint order (HEAD-K, HEAD-V, TAIL-K, TAIL-V, SWEEP-K, SWEEP-V), which is
# the tags' value order, as (tag, phase, half): e.g. (TAIL_V_SWA, "TAIL", "v").
_LAYOUT = {
    kind: tuple((t, t.name.split("_")[0], t.name.split("_")[1].lower()) for t in constants.CanaryLaunchTag
                if t.group == kind.name)
    for kind in PoolKind
}


def build_endpoints_from_group(group: CanaryBufferGroup) -> tuple[CanaryEndpoint, ...]:
    """The group's endpoints in SGLang's order HEAD-K, HEAD-V, TAIL-K, TAIL-V, SWEEP-K, SWEEP-V (V skipped
    without a V half): 3 or 6 endpoints, FULL tags 0..5 or SWA tags 6..11.

    HEAD endpoints get no real-KV sources; SWEEP endpoints share the TAIL buffer and sources of their half.
    Cheap (no copies): rebuild it from the current group whenever the group changes.
    """
    if not isinstance(group, CanaryBufferGroup):
        raise TypeError(f"kv-canary: group must be a CanaryBufferGroup, got {type(group).__name__}")
    lut = group.swa_index_lut if group.kind is PoolKind.SWA else None
    out = []
    for tag, slot, half in _LAYOUT[group.kind]:
        if half == "v" and not group.has_v_half:
            continue
        buffer_name = f"{half}_{'head' if slot == 'HEAD' else 'tail'}"
        sources = () if slot == "HEAD" else getattr(group, f"real_kv_sources_{half}")
        out.append(CanaryEndpoint(kernel_kind=tag, canary_buf=getattr(group, buffer_name),
                                  full_to_swa_index_mapping=lut, real_kv_sources=tuple(sources),
                                  buffer_name=buffer_name))
    return tuple(out)


def select_endpoints(endpoints: Iterable[CanaryEndpoint], phase: str, *,
                     enable_v_half: bool = True) -> tuple[CanaryEndpoint, ...]:
    """Endpoints of one phase (``"head"``, ``"tail"`` or ``"sweep"``), V halves only if ``enable_v_half``
    (SGLang's ``SGLANG_KV_CANARY_ENABLE_MHA_V`` gate; default off there).

    Raises:
      ValueError: an unknown phase.
    """
    phase = str(phase).lower()
    if phase not in ("head", "tail", "sweep"):
        raise ValueError(f"kv-canary: phase must be one of head/tail/sweep, got {phase!r}")
    out = []
    for e in endpoints:
        tag = constants.CanaryLaunchTag(int(e.kernel_kind))
        if not tag.name.lower().startswith(phase + "_"):
            continue
        if tag.is_v_half and not enable_v_half:
            continue
        out.append(e)
    return tuple(out)


def dispatch(
    endpoint: CanaryEndpoint,
    *,
    verify_plan: VerifyPlan,
    violation_log: layout.ViolationLog,
    write_plan: WritePlan | None = None,
    input_ids: Any = None,
    positions: Any = None,
    out_cache_loc: Any = None,
    enable_write_input_assert: bool = False,
    enable_verify_token_assert: bool = False,
    expected_inputs: ExpectedInputs | None = None,
    real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
    backend: str | None = None,
) -> tuple[CanaryEndpoint, layout.ViolationLog]:
    """Routes ``endpoint`` to the launch its tag allows, so callers never hit the NotImplementedError.

    SWEEP tags -> :meth:`CanaryEndpoint.launch_sweep` (the write arguments are ignored; the endpoint comes
    back unchanged); HEAD / TAIL tags -> :meth:`CanaryEndpoint.launch_per_forward`.

    Returns:
      ``(endpoint, violation_log)`` after the launch.

    Raises:
      ValueError: a HEAD / TAIL endpoint without ``write_plan`` / token arrays.
    """
    if endpoint.is_sweep:
        log = endpoint.launch_sweep(verify_plan=verify_plan, violation_log=violation_log,
                                    real_kv_hash_mode=real_kv_hash_mode, backend=backend)
        return endpoint, log
    missing = [n for n, v in (("write_plan", write_plan), ("input_ids", input_ids), ("positions", positions),
                              ("out_cache_loc", out_cache_loc)) if v is None]
    if missing:
        tag = constants.CanaryLaunchTag(int(endpoint.kernel_kind))
        raise ValueError(f"kv-canary: per-forward endpoint {tag.name} needs {', '.join(missing)}")
    return endpoint.launch_per_forward(
        verify_plan=verify_plan, write_plan=write_plan, input_ids=input_ids, positions=positions,
        out_cache_loc=out_cache_loc, violation_log=violation_log,
        enable_write_input_assert=enable_write_input_assert,
        enable_verify_token_assert=enable_verify_token_assert, expected_inputs=expected_inputs,
        real_kv_hash_mode=real_kv_hash_mode, backend=backend)


def launch_group(
    group: CanaryBufferGroup,
    phase: str,
    *,
    verify_plan: VerifyPlan,
    violation_log: layout.ViolationLog,
    enable_v_half: bool = True,
    **launch_kw,
) -> tuple[CanaryBufferGroup, layout.ViolationLog]:
    """Runs every endpoint of ``group`` in ``phase`` (``head`` / ``tail`` / ``sweep``), K before V, through
    :func:`dispatch`, and returns the group with its updated buffers and the new log.

    ``launch_kw`` are :func:`dispatch`'s per-forward arguments (write_plan, input_ids, positions,
    out_cache_loc, enable_write_input_assert, enable_verify_token_assert, expected_inputs,
    real_kv_hash_mode, backend); a sweep uses only real_kv_hash_mode and backend.
    """
    log = violation_log
    for ep in select_endpoints(build_endpoints_from_group(group), phase, enable_v_half=enable_v_half):
        if ep.is_sweep:
            kw = {k: v for k, v in launch_kw.items() if k in ("real_kv_hash_mode", "backend")}
        else:
            kw = launch_kw
        ep, log = dispatch(ep, verify_plan=verify_plan, violation_log=log, **kw)
        if not ep.is_sweep:
            group = group.with_endpoint(ep)
    return group, log

"""Launch endpoints: who verifies and writes which canary buffer, and the dispatch (SPEC 8.2).

Each :class:`~canary_jax.runtime.groups.CanaryBufferGroup` yields up to six :class:`CanaryEndpoint` (HEAD /
TAIL / SWEEP x K / V; no V half for MLA-style pools), built by :func:`build_endpoints_from_group` (SGLang
``endpoint.py``):

* HEAD -> its own buffer (``k_head`` / ``v_head``) and **no real-KV sources** (head records hash 0);
* TAIL -> ``k_tail`` / ``v_tail`` with the real-KV sources of that half (passed in with the launch: a group
  holds no KV data);
* SWEEP -> **shares** the TAIL buffer and the sources of the same half;
* the LUT is the group's ``swa_index_lut`` for SWA groups, None for FULL.

JAX is functional, so an endpoint is a *view* of a group at one moment: a launch returns the updated endpoint
(new ``canary_buf``) and the new :class:`~canary_jax.contract.layout.ViolationLog`, and
:meth:`~canary_jax.runtime.groups.CanaryBufferGroup.with_endpoint` writes the buffer back under the endpoint's
``buffer_name``. Counters need no views: the log holds the per-tag arrays and each launch bumps ``[tag]``.
All endpoints of a manager share one log.

:func:`dispatch` routes any endpoint to the launch its tag allows (``launch_sweep`` for SWEEP tags,
``launch_per_forward`` otherwise); :func:`launch_group` runs a whole phase of a group that way.
:class:`CanaryEndpoint` and :class:`ExpectedInputs` live in :mod:`canary_jax.runtime.launch_endpoint` (which
the groups build on too) and are re-exported here unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from canary_jax.contract import constants, layout
from canary_jax.planning.plans import VerifyPlan, WritePlan
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.launch_endpoint import CanaryEndpoint, ExpectedInputs

__all__ = [
    "CanaryEndpoint",
    "ExpectedInputs",
    "build_endpoints_from_group",
    "dispatch",
    "launch_group",
    "select_endpoints",
    "split_sources",
]


# Per group, its tags in SGLang's endpoint order (HEAD-K, HEAD-V, TAIL-K, TAIL-V, SWEEP-K, SWEEP-V), which is
# the tags' value order, as (tag, phase, half): e.g. (TAIL_V_SWA, "TAIL", "v").
_LAYOUT = {
    kind: tuple(
        (t, t.name.split("_")[0], t.name.split("_")[1].lower())
        for t in constants.CanaryLaunchTag
        if t.group == kind.name
    )
    for kind in PoolKind
}


def build_endpoints_from_group(
    group: CanaryBufferGroup, *, real_kv_sources: tuple | None = None
) -> tuple[CanaryEndpoint, ...]:
    """The group's endpoints in SGLang's order HEAD-K, HEAD-V, TAIL-K, TAIL-V, SWEEP-K, SWEEP-V (V skipped
    without a V half): 3 or 6 endpoints, FULL tags 0..5 or SWA tags 6..11.

    Args:
      group: the :class:`~canary_jax.runtime.groups.CanaryBufferGroup`.
      real_kv_sources: ``(sources_k, sources_v)``: 0..4 :class:`~canary_jax.contract.sources.RealKvSource` per half
        viewing the KV pool now (None or ``()`` for a half without sources), or None for none at all.

    HEAD endpoints get no real-KV sources; TAIL and SWEEP endpoints of a half get that half's sources and SWEEP
    shares the TAIL buffer. Cheap (no copies): rebuild it for every launch.

    Raises:
      TypeError: not a group, or ``real_kv_sources`` not a pair.
      ValueError: V-half sources for a group without a V half.
    """
    if not isinstance(group, CanaryBufferGroup):
        raise TypeError(f"kv-canary: group must be a CanaryBufferGroup, got {type(group).__name__}")
    by_half = dict(zip("kv", split_sources(real_kv_sources, group)))
    lut = group.swa_index_lut if group.kind is PoolKind.SWA else None
    out = []
    for tag, slot, half in _LAYOUT[group.kind]:
        if half == "v" and not group.has_v_half:
            continue
        buffer_name = f"{half}_{'head' if slot == 'HEAD' else 'tail'}"
        sources = () if slot == "HEAD" else by_half[half]
        out.append(
            CanaryEndpoint(
                kernel_kind=tag,
                canary_buf=getattr(group, buffer_name),
                full_to_swa_index_mapping=lut,
                real_kv_sources=tuple(sources),
                buffer_name=buffer_name,
            )
        )
    return tuple(out)


def split_sources(real_kv_sources: tuple | None, group: CanaryBufferGroup) -> tuple[tuple, tuple]:
    """``(sources_k, sources_v)`` as two tuples (None -> ``()``) for ``group``.

    Raises:
      TypeError: ``real_kv_sources`` is not None or a ``(sources_k, sources_v)`` pair.
      ValueError: V-half sources for a group without a V half.
    """
    if real_kv_sources is None:
        return (), ()
    if not isinstance(real_kv_sources, (tuple, list)) or len(real_kv_sources) != 2:
        raise TypeError(
            f"kv-canary: real-KV sources of group {group.kind.name} must be a (sources_k, sources_v) pair, "
            f"got {type(real_kv_sources).__name__}"
        )
    k, v = (() if x is None else tuple(x) for x in real_kv_sources)
    if v and not group.has_v_half:
        raise ValueError(f"kv-canary: V-half real-KV sources given for group {group.kind.name}, which has no V half")
    return k, v


def select_endpoints(
    endpoints: Iterable[CanaryEndpoint], phase: str, *, enable_v_half: bool = True
) -> tuple[CanaryEndpoint, ...]:
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
        log = endpoint.launch_sweep(
            verify_plan=verify_plan, violation_log=violation_log, real_kv_hash_mode=real_kv_hash_mode, backend=backend
        )
        return endpoint, log
    missing = [
        n
        for n, v in (
            ("write_plan", write_plan),
            ("input_ids", input_ids),
            ("positions", positions),
            ("out_cache_loc", out_cache_loc),
        )
        if v is None
    ]
    if missing:
        tag = constants.CanaryLaunchTag(int(endpoint.kernel_kind))
        raise ValueError(f"kv-canary: per-forward endpoint {tag.name} needs {', '.join(missing)}")
    return endpoint.launch_per_forward(
        verify_plan=verify_plan,
        write_plan=write_plan,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        violation_log=violation_log,
        enable_write_input_assert=enable_write_input_assert,
        enable_verify_token_assert=enable_verify_token_assert,
        expected_inputs=expected_inputs,
        real_kv_hash_mode=real_kv_hash_mode,
        backend=backend,
    )


def launch_group(
    group: CanaryBufferGroup,
    phase: str,
    *,
    verify_plan: VerifyPlan,
    violation_log: layout.ViolationLog,
    enable_v_half: bool = True,
    real_kv_sources: tuple | None = None,
    **launch_kw,
) -> tuple[CanaryBufferGroup, layout.ViolationLog]:
    """Runs every endpoint of ``group`` in ``phase`` (``head`` / ``tail`` / ``sweep``), K before V, through
    :func:`dispatch`, and returns the group with its updated buffers and the new log.

    ``real_kv_sources`` is the ``(sources_k, sources_v)`` pair viewing the KV pool now (see
    :func:`build_endpoints_from_group`); HEAD launches never read it.

    ``launch_kw`` are :func:`dispatch`'s per-forward arguments (write_plan, input_ids, positions,
    out_cache_loc, enable_write_input_assert, enable_verify_token_assert, expected_inputs,
    real_kv_hash_mode, backend); a sweep uses only real_kv_hash_mode and backend.
    """
    log = violation_log
    endpoints = build_endpoints_from_group(group, real_kv_sources=real_kv_sources)
    for ep in select_endpoints(endpoints, phase, enable_v_half=enable_v_half):
        if ep.is_sweep:
            kw = {k: v for k, v in launch_kw.items() if k in ("real_kv_hash_mode", "backend")}
        else:
            kw = launch_kw
        ep, log = dispatch(ep, verify_plan=verify_plan, violation_log=log, **kw)
        if not ep.is_sweep:
            group = group.with_endpoint(ep)
    return group, log

"""The passes over a native program's step list, after the jaxpr is flattened and its constants folded: the
:class:`Step` record, each primitive's rule compiled with its constants (:func:`_compile`), runs of views fused
into one step (:func:`_fuse_views`) and the memory plan (:func:`_plan_memory`: donation, dead values, outputs
copied before the write-back; item 3 of :mod:`interop.native.program`'s docstring).

:mod:`interop.native.program` builds the steps, runs these passes in that order and re-exports every name here
(their first home).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from interop.native import prims, prims_views

IN_PLACE = frozenset(
    {"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min"}
    | {"scatter-max", "scatter_max", "dynamic_update_slice"}
)
"""Primitives whose rule updates operand 0 in place when it is donated (and works on a copy otherwise)."""

VIEW_OF_FIRST = frozenset(
    {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "bitcast_convert_type", "convert_element_type"}
    | {"slice", "dynamic_slice", "transpose", "rev", "reduce_precision", "copy", "copy_p"}
)
"""Primitives whose result may be a view of operand 0 only (never of their other operands)."""


@dataclasses.dataclass
class Step:
    """One step: ``run(args, donate) -> outputs`` on the values ``ins``, defining ``outs``."""

    name: str
    run: Callable[[list[torch.Tensor], tuple[bool, ...]], list[torch.Tensor]]
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    fresh: bool  # outputs never share memory with inputs
    inplace: tuple[int, ...] = ()  # input positions the step may overwrite when allowed (else it copies)
    donate: tuple[bool, ...] = ()  # per input: may be overwritten (decided by the memory plan)
    drop: tuple[int, ...] = ()  # values dead after this step (released for the allocator)
    kernel: Any = None  # the pallas_call's kernel object, for reports
    eqns: tuple = ()  # the equations a primitive step runs (compiled once constants are folded)


def _compile(steps: list[Step], consts: dict[int, torch.Tensor], device: torch.device) -> None:
    """Each primitive step's rule compiled for ``device`` with every constant operand (literal, closed-over or
    folded) baked in (:func:`interop.native.prims.compile_rule`)."""
    for s in steps:
        if len(s.eqns) == 1:
            known = {k: consts[i] for k, i in enumerate(s.ins) if i in consts}
            s.run = prims.compile_rule(s.eqns[0], device, known)


def _fuse_views(steps: list[Step], out_ids, device: torch.device) -> list[Step]:
    """Runs of view steps (each the only reader of the one before, which is no program output) as one step
    (:func:`interop.native.prims_views.compile_view_chain`: one or two torch calls on a contiguous input)."""
    readers: dict[int, int] = {}
    for s in steps:
        for i in s.ins:
            readers[i] = readers.get(i, 0) + 1
    outs = set(out_ids)
    fused: list[Step] = []
    chain: list[Step] = []

    def flush():
        if len(chain) == 1:
            fused.append(chain[0])
        elif chain:
            eqns = tuple(e for c in chain for e in c.eqns)
            run = prims_views.compile_view_chain(eqns, device)
            fused.append(Step("view_chain", run, chain[0].ins, chain[-1].outs, False, eqns=eqns))
        chain.clear()

    for s in steps:
        view = len(s.eqns) == 1 and len(s.ins) == 1 and prims_views.is_view(s.eqns[0])
        if view and chain and s.ins[0] == chain[-1].outs[0]:
            chain.append(s)
        else:
            flush()
            if view:
                chain.append(s)
            else:
                fused.append(s)
        if chain and (readers.get(chain[-1].outs[0], 0) != 1 or chain[-1].outs[0] in outs):
            flush()  # the chain's value is read elsewhere too: it ends here
    flush()
    return fused


def _plan_memory(steps: list[Step], in_ids, out_ids, mutable: Sequence[bool], consts: dict) -> tuple[bool, ...]:
    """Sets each step's ``donate`` and ``drop`` (see the module docstring, item 3); returns, per output, whether
    it may share memory with another *mutable* input than its own (then the launch copies it before writing
    results back, so one write-back cannot change another's value)."""
    n_steps = len(steps)
    last: dict[int, int] = {}
    for k, s in enumerate(steps):
        for i in s.ins:
            last[i] = k
    for i in out_ids:
        last[i] = n_steps
    roots: dict[int, frozenset] = {}
    for j, i in enumerate(in_ids):
        roots[i] = frozenset({("in", j)})
    for i in consts:
        roots[i] = frozenset({("const", i)})
    holders: dict[Any, list[int]] = {}
    for i, r in roots.items():
        for root in r:
            holders.setdefault(root, []).append(i)
    read_only = {("in", j) for j, m in enumerate(mutable) if not m}
    for k, s in enumerate(steps):
        donate = []
        for pos, i in enumerate(s.ins):
            ok = pos in s.inplace
            # memory this step also reads through another operand must not change under it
            others = frozenset().union(*(roots.get(j, frozenset()) for q, j in enumerate(s.ins) if q != pos))
            for root in roots.get(i, ()):
                if root[0] == "const" or root in read_only or root in others:
                    ok = False
                elif any(last.get(h, -1) > k for h in holders[root]):
                    ok = False
            donate.append(ok)
        s.donate = tuple(donate)
        own = [frozenset({("step", k, q)}) for q in range(len(s.outs))]
        if s.fresh or (s.name in IN_PLACE and not s.donate[0]):
            out_roots = own  # a fresh result, or the copy an in-place rule made of an operand it could not take
        elif s.name in IN_PLACE or s.name in VIEW_OF_FIRST:
            out_roots = [roots.get(s.ins[0], frozenset()) | o for o in own]
        elif s.name == "pallas_call":
            # an aliased result is its operand's memory when donated, the launch's own copy otherwise
            back = {o: i for i, o in s.kernel.aliases if s.donate[i]}
            out_roots = [roots.get(s.ins[back[q]], frozenset()) | o if q in back else o for q, o in enumerate(own)]
        else:
            shared = frozenset().union(*(roots.get(i, frozenset()) for i in s.ins)) if s.ins else frozenset()
            out_roots = [shared | frozenset({("step", k, q)}) for q in range(len(s.outs))]
        for i, r in zip(s.outs, out_roots):
            roots[i] = r
            for root in r:
                holders.setdefault(root, []).append(i)
    for k, s in enumerate(steps):
        s.drop = tuple(sorted({i for i in s.ins if last.get(i) == k}))
    own_input = [j for j, m in enumerate(mutable) if m]  # output q writes back to mutable input own_input[q]
    return tuple(
        any(r[0] == "in" and r[1] != j and mutable[r[1]] for r in roots.get(i, ()))
        for i, j in zip(out_ids, own_input + [None] * (len(out_ids) - len(own_input)))
    )

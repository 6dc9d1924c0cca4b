"""A traced launch body as a short list of kernel launches: the executor of the native torch path.

:func:`build` takes the closed jaxpr of a launch body (``jax.make_jaxpr`` of a verify / write / plan body of
:mod:`interop.kernels`) and turns it into a :class:`Program`. The native path runs bodies whose work is all in
their kernels:

* each ``pallas_call`` is one kernel launch (a Triton kernel on CUDA tensors, JAX's interpreter on CPU ones);
* layout ops are free: ``reshape``, ``squeeze``, ``expand_dims``, a ``broadcast_in_dim`` that keeps the size,
  ``bitcast_convert_type``, a ``convert_element_type`` between dtypes of one torch storage (``uint32`` /
  ``int32``) and ``copy`` give a value the bytes of their operand, so every value is a contiguous *buffer* seen
  through a shape and dtype;
* an equation whose operands are all literals or constants runs once, at build time, through JAX;
* ``pjit`` / ``jit`` / ``closed_call`` bodies are inlined;
* anything else (a scatter, an elementwise op or control flow on launch data) raises :class:`NotNative`
  naming the primitive: that launch takes the DLPack path, where the native path is only the default.

**Memory plan** (XLA's buffer assignment, conservative). Buffers are the launch's arguments, the constants, and
temporaries. A kernel result aliased to an operand (``input_output_aliases``) is that operand's buffer, updated
in place, when the buffer is no constant, no read-only argument, not read through another operand of the same
kernel, and none of the values it holds now is read later (by a later kernel or as a launch result); otherwise
the kernel works on a fresh copy, as XLA would. Every other result gets a fresh temporary. A mutable argument
whose result is not its own buffer is written back at the end (an argument staged to a contiguous, aligned copy
is written back too).

**Running.** A compiled launch is only pointers: each kernel gets its operands' and results' buffer addresses
(:meth:`interop.native.triton_kernels.TritonKernel.launch_ptrs`) on torch's current stream; nothing reads a
value back to the host, so a torch CUDA graph captures a whole launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core as jcore
import numpy as np
import torch

from interop.native import storage

INLINED = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint")
"""Primitives whose body is inlined."""

LAYOUT = ("reshape", "squeeze", "expand_dims", "broadcast_in_dim", "bitcast_convert_type", "convert_element_type")
"""Primitives that only rename a buffer's bytes (with the conditions in :func:`_layout_ok`), plus ``copy``."""


class NotNative(NotImplementedError):
    """A launch body the native path does not run (the message names the primitive and why)."""


def _size(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def _layout_ok(eqn) -> bool:
    name = eqn.primitive.name
    a, b = eqn.invars[0].aval, eqn.outvars[0].aval
    if name in ("copy", "copy_p", "bitcast_convert_type"):
        return True
    if name == "convert_element_type":
        return storage.storage_dtype(a.dtype) == storage.storage_dtype(b.dtype) and a.dtype.itemsize == b.dtype.itemsize
    if name == "reshape" and eqn.params.get("dimensions") not in (None, ()):
        return False
    return name in LAYOUT and _size(a) == _size(b)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """One kernel launch: operand and result value ids, and the kernel (``aliases``: (operand, result) pairs)."""

    kernel: Any
    ins: tuple[int, ...]
    outs: tuple[int, ...]


class _Tracer:
    """Walks a closed jaxpr: value ids, each the bytes of a root value (an argument, a constant or a kernel
    result), and the kernel launches over them."""

    def __init__(self, device: torch.device, kernel_for: Callable):
        self.device, self.kernel_for = device, kernel_for
        self.avals: list = []
        self.root: list[int] = []  # value id -> the value whose bytes it is
        self.known: dict[int, Any] = {}  # value id -> numpy value (literals, constants, folded)
        self.kernels: list[_Kernel] = []

    def new(self, aval, root: int | None = None) -> int:
        self.avals.append(aval)
        self.root.append(len(self.root) if root is None else self.root[root])
        return len(self.avals) - 1

    def read(self, env: dict, v) -> int:
        if isinstance(v, jcore.Literal):
            i = self.new(v.aval)
            self.known[i] = np.asarray(v.val, dtype=v.aval.dtype)
            return i
        return env[v]

    def inline(self, jaxpr, consts: Sequence, args: Sequence[int]) -> list[int]:
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.new(v.aval)
            self.known[env[v]] = np.asarray(c)
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [self.read(env, v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [self.read(env, v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: list[int]) -> list[int]:
        name = eqn.primitive.name
        if name in INLINED:
            sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
            if isinstance(sub, jcore.ClosedJaxpr):
                return self.inline(sub.jaxpr, sub.consts, ins)
            return self.inline(sub, (), ins)
        if name != "pallas_call" and all(i in self.known for i in ins):
            return self.fold(eqn, ins)
        if name == "pallas_call":
            outs = [self.new(v.aval) for v in eqn.outvars]
            self.kernels.append(_Kernel(self.kernel_for(eqn), tuple(ins), tuple(outs)))
            return outs
        if len(ins) == 1 and len(eqn.outvars) == 1 and _layout_ok(eqn):
            return [self.new(eqn.outvars[0].aval, root=ins[0])]
        raise NotNative(
            f"{name!r} on launch data outside the kernels (the native path runs only the launch's kernels and "
            "layout ops); the DLPack path (path='dlpack') runs it"
        )

    def fold(self, eqn, ins: list[int]) -> list[int]:
        """An equation of constants, evaluated now by JAX (once per launch shape)."""
        vals = eqn.primitive.bind(*[self.known[i] for i in ins], **eqn.params)
        vals = vals if eqn.primitive.multiple_results else [vals]
        outs = []
        for v, x in zip(eqn.outvars, vals):
            i = self.new(v.aval)
            self.known[i] = np.asarray(x)
            outs.append(i)
        return outs


@dataclasses.dataclass
class Program:
    """A launch body as kernel launches over buffers: ``program(inputs)`` runs it on the launch's tensors and
    writes the mutable ones back in place. A tensor may come in any shape and dtype that holds its argument's
    bytes (an ``int64[n]`` for the body's ``uint32[n, 2]``): kernels take data pointers, and every other use sees
    a buffer through :func:`interop.native.storage.as_value`."""

    avals_in: tuple  # per argument, (shape, torch storage dtype)
    consts: list[torch.Tensor]  # buffer id num_inputs + k
    temps: list[tuple]  # buffer id num_inputs + len(consts) + k: (shape, torch dtype) of its first value
    steps: list[tuple]  # (kernel, operand buffers, result buffers, [(temp, source buffer) copies before it],
    # operand and result (shape, torch dtype))
    writes: list[tuple[int, int]]  # (argument, buffer holding its result) written back at the end
    align: tuple[int, ...]  # per argument, the byte alignment its data pointer needs
    compiled: bool

    @property
    def kernel_names(self) -> list[str]:
        """The kernels the launch runs, in order (``pallas_call`` names)."""
        return [step[0].name for step in self.steps if not isinstance(step[0], _Copy)]

    @property
    def num_kernels(self) -> int:
        return len(self.kernel_names)

    def stage(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """The arguments as buffers: each contiguous and aligned as its kernels need, else a copy (listed)."""
        bufs, staged = list(inputs), []
        for j, (t, al) in enumerate(zip(inputs, self.align)):
            if not t.is_contiguous() or t.data_ptr() % al:
                bufs[j] = t.clone(memory_format=torch.contiguous_format)
                staged.append(j)
        return bufs, staged

    def __call__(self, inputs: Sequence[torch.Tensor]) -> None:
        bufs, staged = self.stage(inputs)
        bufs.extend(self.consts)
        dev = inputs[0].device if inputs else torch.device("cpu")
        bufs.extend([None] * len(self.temps))
        base = len(inputs) + len(self.consts)
        for kernel, ins, outs, copies, avals_in, avals_out in self.steps:
            for t, src in copies:
                bufs[t] = bufs[src].clone()
            if self.compiled:
                for b in outs:
                    if bufs[b] is None:
                        shape, st = self.temps[b - base]
                        bufs[b] = torch.empty(shape, dtype=st, device=dev)
                kernel.launch_ptrs([bufs[b].data_ptr() for b in (*ins, *outs)])
                continue
            args = [storage.as_value(bufs[b], *a) for b, a in zip(ins, avals_in)]
            for b, a, res in zip(outs, avals_out, kernel.interpret(args)):
                if bufs[b] is None:
                    bufs[b] = res
                else:
                    storage.as_value(bufs[b], *a).copy_(res)
        staged_set = set(staged)
        for j, b in self.writes:
            if b != j or j in staged_set:
                inputs[j].copy_(storage.as_value(bufs[b], inputs[j].shape, inputs[j].dtype))


def build(closed: jcore.ClosedJaxpr, *, device: torch.device, mutable: Sequence[bool], kernel_for: Callable) -> Program:
    """Compiles a closed launch jaxpr to a :class:`Program` on ``device``.

    Args:
      closed: the launch body's closed jaxpr; its outputs are the new values of the mutable inputs, in order.
      device: where the launch's tensors live.
      mutable: per flat input, whether the launch may overwrite it.
      kernel_for: ``eqn -> kernel`` for a ``pallas_call`` equation: an object with ``aliases`` ((operand,
        result) pairs) and either ``launch_ptrs(ptrs)`` and ``alignments`` (compiled) or ``interpret(args) ->
        results`` (interpreted).

    Raises:
      NotNative: an equation on launch data that is neither a kernel nor a layout op, or kernels of both kinds.
    """
    tr = _Tracer(device, kernel_for)
    n_in = len(closed.jaxpr.invars)
    in_ids = [tr.new(v.aval) for v in closed.jaxpr.invars]
    out_ids = tr.inline(closed.jaxpr, closed.consts, in_ids)
    kinds = {hasattr(k.kernel, "launch_ptrs") for k in tr.kernels}
    if len(kinds) > 1:
        raise NotNative("a launch with both compiled and interpreted kernels")
    compiled = kinds == {True}

    # buffers: arguments, then constants (known roots read by kernels or returned), then temporaries
    buf: dict[int, int] = {r: j for j, r in enumerate(in_ids)}  # root value -> buffer
    consts: list[torch.Tensor] = []

    def buffer_of(v: int) -> int:
        r = tr.root[v]
        if r not in buf:  # a known value
            buf[r] = n_in + len(consts)
            consts.append(storage.from_numpy(tr.known[r], device))
        return buf[r]

    used = [i for k in tr.kernels for i in k.ins] + list(out_ids)
    for v in used:
        if tr.root[v] in tr.known:
            buffer_of(v)
    last: dict[int, int] = {}  # root -> last kernel index reading it (len(kernels): a launch result)
    for k, kern in enumerate(tr.kernels):
        for i in kern.ins:
            last[tr.root[i]] = k
    for i in out_ids:
        last[tr.root[i]] = len(tr.kernels)
    holds: dict[int, list[int]] = {}  # buffer -> roots whose bytes it has held
    for r, b in buf.items():
        holds.setdefault(b, []).append(r)
    temps: list[tuple] = []
    align = [1] * n_in

    def form(aval) -> tuple:
        return tuple(aval.shape), storage.storage_dtype(aval.dtype)

    steps = []

    def temp(aval) -> int:
        temps.append(form(aval))
        return n_in + len(consts) + len(temps) - 1

    for k, kern in enumerate(tr.kernels):
        ins = [buffer_of(i) for i in kern.ins]
        aliased = {o: i for i, o in kern.kernel.aliases}
        copies, outs = [], []
        for q, o in enumerate(kern.outs):
            p = aliased.get(q)
            if p is None:
                b = temp(tr.avals[o])
            else:
                b = ins[p]
                others = {x for n, x in enumerate(ins) if n != p}
                free = (b < n_in and mutable[b]) or b >= n_in + len(consts)
                if not free or b in others or any(last.get(r, -1) > k for r in holds.get(b, ())):
                    t = temp(tr.avals[o])
                    copies.append((t, b))
                    ins[p] = b = t
            buf[o] = b
            holds.setdefault(b, []).append(o)
            outs.append(b)
        if compiled:
            al = kern.kernel.alignments
            for n, b in enumerate((*ins, *outs)):
                if b < n_in:
                    align[b] = max(align[b], int(al[n]))
        avals_in = tuple(form(tr.avals[i]) for i in kern.ins)
        avals_out = tuple(form(tr.avals[o]) for o in kern.outs)
        steps.append((kern.kernel, tuple(ins), tuple(outs), copies, avals_in, avals_out))

    targets = [j for j in range(n_in) if mutable[j]]
    writes = [(j, buffer_of(v)) for j, v in zip(targets, out_ids)]
    # a result held in another argument's buffer is copied first, so no write-back changes another's source
    sources_in_args = [(j, b) for j, b in writes if b < n_in and b != j and mutable[b]]
    if sources_in_args:
        for n, (j, b) in enumerate(writes):
            if (j, b) in sources_in_args:
                t = temp(closed.jaxpr.invars[b].aval)
                steps.append((_Copy(), (b,), (t,), [(t, b)], (), ()))
                writes[n] = (j, t)
    return Program(
        tuple(form(v.aval) for v in closed.jaxpr.invars),
        consts,
        temps,
        steps,
        writes,
        tuple(align),
        compiled,
    )


class _Copy:
    """A step that only makes its copies (a write-back source moved out of the way); launches nothing."""

    aliases = ()
    name = "copy"

    def launch_ptrs(self, ptrs) -> None:
        del ptrs

    def interpret(self, args):
        del args
        return []

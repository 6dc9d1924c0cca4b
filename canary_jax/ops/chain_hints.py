"""Chain reuse between the write launches of one step: HEAD-K computes the serial chains, HEAD-V, TAIL-K and
TAIL-V reuse them where their own canary buffer gives the same chain start (the Pallas write does so for the
long-request role, a prefill's chains; a decode launch's one-step chains cost less than carrying a hint).

Every write launch of a step writes the same tokens (same plan, ``input_ids``, ``positions``, ``out_cache_loc``)
into a different canary buffer (``k_head``, ``v_head``, ``k_tail``, ``v_tail``). Its serial chain, the costly
part of a prefill write, depends on the buffer only through each request's chain start: the running prev_hash
after the seed slot's record, the run position and the chain-position gate (SPEC 6). So a launch that gets a
:class:`ChainHint` from an earlier launch of the step compares, per request, its own chain start with the hint's
and replays the chain only where they differ (a corrupted seed record): the same bytes as computing it, with the
serial work done once per step instead of once per launch.

The step phases (:mod:`canary_jax.runtime.phases`) open a :func:`chain_scope` per group around its launches; a
backend that can reuse (the Pallas write) reads :func:`current` outside its own ``jit``, passes the hint in as
an argument and, when the scope has none yet, leaves its own there. A write outside any scope (the public
:func:`canary_jax.write`) neither reads nor leaves one. The hint is data (no KV bytes): entry flags, prev_hash
and run positions, and per request the chain start.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax


@dataclasses.dataclass(frozen=True, slots=True)
class ChainHint:
    """One write launch's chains (a pytree; the statics say which launches may reuse it).

    Fields:
      flags: ``uint32[T]``: per entry, the write kernels' flag word after the chains (written, input-assert and
        chain-position bits; see ``pallas_kernels.write_flags``).
      prev_at, chain_exp: ``uint32[2 T]``: per entry, the running prev_hash before it and the run position
        (the chain-position expectation), as flat int64 pairs.
      req_state: ``uint32[Cw, 5]``: per request row, its chain start: running prev_hash (lo, hi), run position
        (lo, hi) and the gate (0 / 1).
      n_slots: static, the canary buffer's slot count (it decides which entries are written).
      assert_inputs: static, whether the input assert ran (its bits are in ``flags``).
    """

    flags: jax.Array
    prev_at: jax.Array
    chain_exp: jax.Array
    req_state: jax.Array
    n_slots: int
    assert_inputs: bool

    def fits(self, *, num_tokens: int, cw: int, n_slots: int, assert_inputs: bool) -> bool:
        """Whether a launch of these statics may reuse the hint (else it computes its chains itself)."""
        return (
            self.flags.shape == (num_tokens,)
            and self.req_state.shape == (cw, 5)
            and self.n_slots == n_slots
            and self.assert_inputs == assert_inputs
        )


jax.tree_util.register_dataclass(
    ChainHint, data_fields=["flags", "prev_at", "chain_exp", "req_state"], meta_fields=["n_slots", "assert_inputs"]
)


class ChainScope:
    """The hint shared by the write launches of one group in one step (``hint`` is None until a launch leaves
    one)."""

    def __init__(self, hint: ChainHint | None = None):
        self.hint = hint


_SCOPE: contextvars.ContextVar[ChainScope | None] = contextvars.ContextVar("canary_chain_scope", default=None)


@contextlib.contextmanager
def chain_scope(hint: ChainHint | None = None) -> Iterator[ChainScope]:
    """Opens the scope of one group's write launches (traced together, or with ``hint`` carried over from an
    earlier program of the same step); yields it, so the caller can take the hint left in it."""
    scope = ChainScope(hint)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current() -> ChainScope | None:
    """The open scope, or None outside every scope."""
    return _SCOPE.get()

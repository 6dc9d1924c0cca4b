"""torch interop for canary-jax: DLPack exchange and SGLang drop-in launchers (requires torch).

* :mod:`interop.dlpack`: zero-copy torch <-> JAX exchange (``to_jax``, ``to_torch``, ``int64_pairs_view``),
  refusing non-contiguous, misaligned and narrowing imports and consumed capsules.
* :mod:`interop.inplace`: running a jitted JAX function on torch tensors, updating them in place, ordered
  against torch's current CUDA stream.
* :mod:`interop.sglang`: SGLang's ``launch_canary_{plan,verify,write}_kernel(s)`` and launch objects.

``canary_jax`` never imports this package or torch.
"""

from interop.dlpack import ImportCache, as_torch_tensor, int64_pairs_view, to_jax, to_torch
from interop.inplace import (
    TensorArg,
    donation_aliases,
    last_launch_report,
    run_in_place,
    set_stream_sync,
    stream_sync,
    trace_count,
)

__all__ = [
    "ImportCache",
    "TensorArg",
    "as_torch_tensor",
    "donation_aliases",
    "int64_pairs_view",
    "last_launch_report",
    "run_in_place",
    "set_stream_sync",
    "stream_sync",
    "to_jax",
    "to_torch",
    "trace_count",
]

"""torch interop for canary-jax: DLPack exchange and SGLang drop-in launchers (requires torch).

* :mod:`interop.dlpack`: zero-copy torch <-> JAX exchange (``to_jax``, ``to_torch``, ``int64_pairs_view``),
  refusing non-contiguous, misaligned and narrowing imports and consumed capsules.
* :mod:`interop.runner`: running a jitted JAX function on torch tensors, updating them in place
  (:mod:`interop.buffers`: how each tensor is imported and written back; :mod:`interop.streams`: ordering
  against torch's current CUDA stream).
* :mod:`interop.kernels`: the verify / write / plan bodies the launchers run.
* :mod:`interop.arguments`: torch tensors as the facts :mod:`canary_jax.contract.validation` checks.
* :mod:`interop.sglang`: SGLang's ``launch_canary_{plan,verify,write}_kernel(s)``; their launch objects are
  :mod:`interop.sglang_types` and the plan launcher :mod:`interop.sglang_plan` (both re-exported by
  :mod:`interop.sglang`); :mod:`interop.sglang_launch` is the launch prologue they share.

``canary_jax`` never imports this package or torch.
"""

from interop.dlpack import ImportCache, as_torch_tensor, int64_pairs_view, to_jax, to_torch
from interop.runner import TensorArg, donation_aliases, last_launch_report, run_in_place, trace_count
from interop.streams import set_stream_sync, stream_sync

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

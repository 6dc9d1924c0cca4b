"""Does this jax lower a Pallas-Triton ``atomic_max`` on an int32 *vector* (the write's slot claim)? Lowers a
minimal kernel two ways, int32 values on an int32 ref and float32 bit patterns on a float32 ref, to Triton IR
with :func:`interop.native.triton_ttir.kernel_spec` (works on a CPU host) and prints the atomic ops or the error.
Usage: ``python -m benchmarks.atomic_lowering_probe``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from interop.native import triton_ttir


def _probe(dtype) -> str:
    def kern(idx_ref, val_ref, w_in, w_ref):
        del w_in
        i = jnp.arange(128, dtype=jnp.int32)
        v = val_ref[i]
        m = idx_ref[i] > 0
        pltriton.atomic_max(w_ref, (jnp.where(m, idx_ref[i], 0), jnp.full((128,), 2, jnp.int32)), v, mask=m)

    def f(idx, val, w):
        return pl.pallas_call(
            kern,
            out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
            input_output_aliases={2: 0},
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            name="atomic_probe",
        )(idx, val, w)

    sds = jax.ShapeDtypeStruct
    closed = jax.make_jaxpr(f)(sds((128,), jnp.int32), sds((128,), dtype), sds((4096, 8), dtype))
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call")
    try:
        spec = triton_ttir.kernel_spec(eqn)
    except Exception as e:  # noqa: BLE001 - the probe reports any lowering failure
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    text = getattr(spec, "ttir", None) or str(spec)
    return "; ".join(line.strip()[:160] for line in text.splitlines() if "atomic" in line) or "no atomic op"


if __name__ == "__main__":
    print("jax", jax.__version__)
    for dt in (jnp.int32, jnp.float32):
        print(jnp.dtype(dt).name, "->", _probe(dt))

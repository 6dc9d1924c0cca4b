"""Pallas (Triton) GPU kernels of canary-jax: ``verify.verify_pallas`` and ``write.write_pallas``.

``canary_jax.ops.backends`` names them (``"module:function"``) and imports them on first use as the ``pallas``
backend; see ``pallas_kernels/README.md``.
"""

"""Pallas (Triton) GPU kernels of canary-jax: ``verify.verify_pallas`` and ``write.write_pallas``.

``canary_jax.ops.launch`` imports them lazily as the ``pallas`` backend; see ``pallas_kernels/README.md``.
"""

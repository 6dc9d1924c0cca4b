"""Pallas TPU (Mosaic) kernels: verify (:mod:`pallas_kernels.tpu.verify`) and write (:mod:`pallas_kernels.tpu.write`).

The ``pallas_tpu`` backend of :mod:`canary_jax.ops.backends`. Written for the TPU's rules (no 64-bit integers:
:mod:`canary_jax.contract.pairs` words; slot numbers in SMEM through scalar prefetch; canary rows and real-KV
bytes gathered from HBM with manual, double-buffered async copies; no atomics). On a machine without a TPU they
run under Pallas's TPU interpret mode (``pltpu.InterpretParams``).
"""

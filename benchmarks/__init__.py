"""GPU benchmarks and probes of canary-jax; each script runs from the repository root as a module.

* ``python -m benchmarks.bench``: the Pallas verify / write kernels against the jnp references and a CUDA
  peer (``benchmarks.harness`` holds the cases' data, timing and environment record; ``benchmarks.kernel_cases``
  the verify / write cases and the knob probe; ``benchmarks.cuda_peer`` the peer).
* ``python -m benchmarks.sweep_verify``: PallasConfig variants of the verify kernel (``benchmarks.sweep_variants``
  the presets, ``benchmarks.sweep_scenario`` the data and reference logs, ``benchmarks.sweep_measure`` one variant,
  ``benchmarks.sweep_report`` the table and page, ``benchmarks.ptx_inspect`` PTX / ptxas).
* ``python -m benchmarks.serving_step``: a Qwen3-0.6B-shaped engine with the canary inside its jitted step (decode b1 /
  b128, chunked prefill, the 4096 x 1 decode write): canary off / NONE / PARTIAL / ALL, and the canary's parts.
* ``python -m benchmarks.demo_probe``: the demo's served step split into host batch build, dispatch and device wait.
* ``python -m benchmarks.interop_bench``: torch-launched against JAX-launched calls (``benchmarks.interop_setup``).
* ``python -m benchmarks.compile_probe``, ``python -m benchmarks.mosaic_probe``: offline compile and Mosaic GPU
  probes. ``python -m benchmarks.write_small_probe``: the phase and fused write with the small write body and
  without it, compiled offline for sm_90 (compile time, PTX loads / stores / barriers, registers).
* ``python -m benchmarks.tpu_bench``: the TPU run (bench.py's cases and the serving step, ``pallas_tpu`` against
  ``reference``; refuses without a TPU). ``python -m benchmarks.tpu_launches``: a decode step's launches with
  ``pallas_tpu``, lowered for a TPU on any host (``docs/tpu_cost_model.md``).
* ``bash benchmarks/pallas_gpu_session.sh``, ``bash benchmarks/interop_gpu_session.sh``: one device call each.

Figures live in ``benchmarks/results/`` (its ``README.md`` says which file holds what).
"""

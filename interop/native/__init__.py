"""The native torch path of the SGLang launchers: the launch bodies' Pallas kernels as Triton kernels, no JAX
per launch, capturable in a torch CUDA graph (``interop/README.md``, "The native path").

* :mod:`interop.native.launch`: path choice (:func:`~interop.native.launch.resolve_path`), the traced program per
  launch shape, the write-back;
* :mod:`interop.native.program`: a launch jaxpr as kernel launches over buffers, with a memory plan;
* :mod:`interop.native.triton_ttir` (with :mod:`interop.native.ttir_text`) / :mod:`interop.native.triton_kernels`: a
  ``pallas_call`` as a Triton kernel;
* :mod:`interop.native.replay`: a launch that repeats with the same tensors replays its own CUDA graph (its keys
  also name what the launchers' checks read, :data:`interop.sglang_launch.CHECKED`);
* :mod:`interop.native.environ`: the environment variables a launch reads, at a dict lookup's cost.
"""

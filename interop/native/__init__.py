"""The native torch path: a launch's jaxpr executed with torch ops and Triton kernels (issue #15)."""

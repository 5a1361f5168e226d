"""The shared vocabulary of the engine: what a request is, how it samples, the device batch a
step reads, and the step the scheduler picked.  Imports nothing else of umem_jax."""

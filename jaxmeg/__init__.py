"""jaxmeg: Megatron-LM style 3D parallelism (data, pipe, tensor) in JAX."""

__version__ = "0.1.0"

"""spec_jax: speculative decoding for JAX/Flax language models."""

__version__ = "0.1.0"

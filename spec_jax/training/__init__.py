"""spec_jax.training"""

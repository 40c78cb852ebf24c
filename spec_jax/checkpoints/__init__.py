"""spec_jax.checkpoints"""

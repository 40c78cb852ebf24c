"""spec_jax.decoding"""

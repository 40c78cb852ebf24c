"""spec_jax.drafters"""

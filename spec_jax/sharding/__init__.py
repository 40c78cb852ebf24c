"""spec_jax.sharding"""

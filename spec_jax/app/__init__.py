"""The application layer: the `spec-jax` command line (`main`, one module per command) and the
measurement code behind `spec-jax bench` (`bench`, `roofline`). The library (models, drafters,
decoding, sharding, checkpoints, training) never imports this package.
"""

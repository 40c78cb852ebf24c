"""Eight fake CPU devices and cheap CPU codegen for the subprocess workers (sharding_worker.py,
byo_sharding_worker.py): import this first, before jax. JAX fixes its device count when the
backend starts, so the pytest process (one device) cannot run these checks itself; the workers
compare tokens, not speed, so unoptimised codegen keeps each loop compile a few seconds."""

import os

_CHEAP = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_flags = os.environ.get("XLA_FLAGS", "")  # a worker started by the suite inherits the cheap flags
os.environ["XLA_FLAGS"] = (
    _flags + " --xla_force_host_platform_device_count=8" + ("" if _CHEAP in _flags else " " + _CHEAP)
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

"""Eight fake CPU devices and cheap CPU codegen for the subprocess workers (sharding_worker.py,
byo_sharding_worker.py): import this first, before jax. JAX fixes its device count when the
backend starts, so the pytest process (one device) cannot run these checks itself; the workers
compare tokens, not speed, so unoptimised codegen keeps each loop compile a few seconds."""

import os

from cheap_xla import with_cheap_flags

os.environ["XLA_FLAGS"] = with_cheap_flags(
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

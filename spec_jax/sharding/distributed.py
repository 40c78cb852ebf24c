"""Multi-process start-up: one Python process per host, all devices in one global mesh.

On a Cloud TPU pod slice (v5e-16, v5p-32, ...) every worker runs the same command and
`jax.distributed.initialize()` finds the coordinator and process ids from the TPU metadata by
itself. On multi-GPU hosts (or anywhere without auto-detection) pass the coordinator address,
the number of processes and this process's id, or set them in the environment
(SPEC_JAX_COORDINATOR, SPEC_JAX_NUM_PROCESSES, SPEC_JAX_PROCESS_ID) from your launcher.
Single-host runs need none of this: `initialize_distributed` is then a no-op.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Sequence

import jax

logger = logging.getLogger(__name__)

_ENV_COORDINATOR = "SPEC_JAX_COORDINATOR"
_ENV_NUM_PROCESSES = "SPEC_JAX_NUM_PROCESSES"
_ENV_PROCESS_ID = "SPEC_JAX_PROCESS_ID"

_initialized = False


def _on_tpu_pod() -> bool:
    # TPU VM workers of a multi-host slice carry these (set by the TPU runtime / metadata).
    hostnames = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hostnames or bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    *,
    auto: bool | None = None,
) -> bool:
    """Join the multi-process JAX runtime; call once per process before anything touches devices.

    coordinator_address "host:port" of process 0, num_processes, process_id: explicit setup
      (multi-GPU hosts). Missing values are read from SPEC_JAX_* environment variables.
    auto: True forces `jax.distributed.initialize()` with auto-detection (TPU pods, SLURM,
      Open MPI); None auto-detects only on a multi-host TPU slice; False never does.
    Returns True when the distributed runtime was initialized (now or earlier), False for a
    single-process run.
    """
    global _initialized
    if _initialized:
        return True
    coordinator_address = coordinator_address or os.environ.get(_ENV_COORDINATOR)
    if num_processes is None and os.environ.get(_ENV_NUM_PROCESSES):
        num_processes = int(os.environ[_ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(_ENV_PROCESS_ID):
        process_id = int(os.environ[_ENV_PROCESS_ID])
    explicit = coordinator_address is not None
    if explicit:
        if num_processes is None or process_id is None:
            raise ValueError(
                "A coordinator address needs num_processes and process_id too (or set "
                f"{_ENV_NUM_PROCESSES} and {_ENV_PROCESS_ID})."
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} must be in [0, {num_processes}).")
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
        )
    elif auto or (auto is None and _on_tpu_pod()):
        jax.distributed.initialize()
    else:
        return False
    _initialized = True
    logger.info(
        "JAX distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )
    return True


def is_main_process() -> bool:
    """True on process 0 (and in every single-process run): the one that prints and writes."""
    return jax.process_index() == 0


def main_print(*args: Any, file: Any = None, **kwargs: Any) -> None:
    """`print` on process 0 only, so a pod run prints each result once."""
    if is_main_process():
        print(*args, file=file if file is not None else sys.stdout, **kwargs)

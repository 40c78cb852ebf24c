"""One of the two processes test_multiprocess.py starts: 4 fake CPU devices here, 8 in all.

Joins the other process through `spec_jax.sharding.initialize_distributed` (a coordinator on
127.0.0.1, CPU collectives through gloo), runs `multiprocess_testlib.run_checks` on the global
data=2,model=4 mesh, writes the trained params and Adam moments to OUT_DIR/process<id>.npz and
prints the rest as one JSON line (gloo writes its own lines to stdout too). Each process writes its
own copy, so the test sees that both got every row and every weight back.

usage: python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
"""

from __future__ import annotations

import os
import sys

from cheap_xla import with_cheap_flags  # tests/ is sys.path[0]

# Before jax starts its backend: 4 devices per process (fake_devices.py gives one process 8).
os.environ["XLA_FLAGS"] = with_cheap_flags(
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from spec_jax.sharding import (  # noqa: E402
    DEFAULT_RULES,
    batch_sharding,
    gather_to_host,
    initialize_distributed,
    make_mesh,
)
from spec_jax.sharding.rules import place  # noqa: E402

from multiprocess_testlib import MESH, run_checks  # noqa: E402


def main() -> None:
    process_id, num_processes, port = (int(x) for x in sys.argv[1:4])
    out_dir = Path(sys.argv[4])
    # gloo is JAX's default for CPU collectives; set here because this test is about it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    t0 = time.perf_counter()
    initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)
    mesh = make_mesh(MESH)
    out = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
        # The process of each mesh position: [[0, 0, 0, 0], [1, 1, 1, 1]] puts `data` across them.
        "mesh_processes": [[d.process_index for d in row] for row in mesh.devices],
    }
    out.update(run_checks(mesh))
    # A host-local leaf beside a global one comes back as it is (process_allgather would stack
    # every process's copy of it).
    spread = place(np.arange(8), batch_sharding(mesh, DEFAULT_RULES, (8,)))
    mixed = gather_to_host({"global": spread, "local": np.arange(3) * (process_id + 1)})
    out["mixed_gather"] = {k: np.asarray(v).tolist() for k, v in mixed.items()}
    train = out["train"]
    np.savez(out_dir / f"process{process_id}.npz",
             **{f"params{k}": v for k, v in train.pop("params").items()},
             **{f"moment{k}": v for k, v in train.pop("moment").items()})
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

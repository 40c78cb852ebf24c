"""`spec-jax serve` with a fault put into `Engine.decode` (the half of a step that runs the chunk),
for tests/test_serve.py:

    python tests/serve_fault_worker.py fail serve ARGS...   # every chunk raises a simulated device error
    python tests/serve_fault_worker.py slow serve ARGS...   # every chunk first sleeps SLOW_STEP_S

`fail` shows what the server does when the device fails; `slow` keeps requests running past a
short --drain-timeout. The rest is the command itself (`spec_jax.app.main.main`)."""

from __future__ import annotations

import sys
import time

from spec_jax.app.main import main
from spec_jax.decoding.engine import Engine

SLOW_STEP_S = 0.1


def failing_step(self):
    raise RuntimeError("simulated device error (CUDA_ERROR_ILLEGAL_ADDRESS)")


def slow_step(self, _decode=Engine.decode):
    time.sleep(SLOW_STEP_S)
    return _decode(self)


if __name__ == "__main__":
    mode, argv = sys.argv[1], sys.argv[2:]
    Engine.decode = {"fail": failing_step, "slow": slow_step}[mode]
    sys.exit(main(argv))

"""Worker for tests/test_families.py: the compile-heavy checks in a fresh process with cheap CPU
codegen (XLA's backend optimisation off; tokens are compared, not speed, as in
tests/fake_devices.py): every speculative case of SPEC_CASES against transformers' greedy tokens,
and check_target on each family. Prints one JSON line."""

import os

from cheap_xla import with_cheap_flags  # noqa: E402  (tests/ is on PYTHONPATH)

os.environ["XLA_FLAGS"] = with_cheap_flags(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import test_families as tf  # noqa: E402  (tests/ is on PYTHONPATH)


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        models = tf.build_family_models(Path(root))
        report = {
            "check_target": {name: tf.run_check_target(loaded) for name, (_, _, loaded) in models.items()},
            "speculative": {tf.case_id(*case): tf.run_speculative_case(models, *case) for case in tf.SPEC_CASES},
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

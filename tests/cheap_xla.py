"""Cheap CPU codegen for every process the suite starts (pytest's workers, the subprocess workers,
the CLI and servers the tests run): the suite checks tokens and distributions, not speed, and its
time is mostly XLA compiling tiny models' loops.

- Backend optimisation off and LLVM's expensive passes off: about half the compile time.
- XLA:CPU's older loop emitters instead of its MLIR fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`): a DraftModel loop's backend compile went 62 s -> 31-39 s
  on this 2-core machine (measured under load, three runs each, 2026-11-26); the numerics are
  XLA's either way and the suite compares speculative with plain decoding in the same process.
  Only for the jaxlib versions it was measured on, since XLA aborts on a flag it does not know.
- No HLO constant folding (`--xla_disable_hlo_passes=constant_folding`): XLA evaluates constant
  subexpressions on the host, element by element, while it compiles; the tests' programs compute
  them at run time instead. Per-test CPU seconds, each file alone, back to back (2026-11-26,
  issue 39): test_speculative_greedy 105 -> 80, test_sampling_stats 157 -> 147, test_trees
  178 -> 176.
"""

from __future__ import annotations

from importlib.metadata import version

_FLAGS = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
          "--xla_disable_hlo_passes=constant_folding"]
if tuple(int(p) for p in version("jaxlib").split(".")[:2]) >= (0, 10):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
CHEAP_XLA_FLAGS = " ".join(_FLAGS)


def with_cheap_flags(xla_flags: str) -> str:
    """`xla_flags` plus the cheap ones it lacks (a worker started by the suite inherits them)."""
    missing = [f for f in _FLAGS if f not in xla_flags.split()]
    return " ".join([xla_flags.strip(), *missing]).strip()

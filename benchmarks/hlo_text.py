"""Reading XLA's optimized HLO text (`compiled.as_text()`): computations, their instructions, the
loop bodies, and which instructions launch work. Used by the GPU suite's profile probes
(`gpu_quick.py`), `tree_step_ops.py` and the tests that guard the compiled programs' shape.

A line of an instruction reads `[ROOT ]%name = TYPE opcode(operands), attributes`, TYPE a shape
or a tuple of shapes ("(s32[], f32[2]{0})"); a computation opens with `[ENTRY ]%name (...) -> ...
{` and closes with `}`. XLA:GPU names a fusion's kernel after its instruction, '.' and '-' as '_'.
"""

from __future__ import annotations

import re

COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<type>\(.*?\)|\S+) (?P<op>[a-z][\w\-]*)\("
                         r"(?P<rest>.*)$")
CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")
METADATA = re.compile(r",? metadata=\{[^}]*\}")
# Instructions that launch nothing: they name, pack or reinterpret buffers.
FREE = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
                   "replica-id", "opt-barrier"})


def computations(hlo: str, *, metadata: bool = False) -> dict[str, list[str]]:
    """HLO module text -> {computation name: its instruction lines}, metadata dropped unless asked
    for (it names the JAX scope and source line each instruction came from)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if not metadata:
            line = METADATA.sub("", line)
        header = COMPUTATION.match(line) if " = " not in line else None
        if header:
            current = header.group(1)
            out[current] = []
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None and INSTRUCTION.match(line):
            out[current].append(line)
    return out


def entry_computation(hlo: str, *, metadata: bool = False) -> list[str]:
    """The entry computation's instructions: what one call of the program launches, loops aside."""
    name = next(COMPUTATION.match(line).group(1) for line in hlo.splitlines() if line.startswith("ENTRY "))
    return computations(hlo, metadata=metadata)[name]


def while_bodies(hlo: str) -> list[str]:
    """The names of the program's while bodies, in the text's order."""
    return [m.group(1) for m in re.finditer(r"body=%?([\w.\-]+)", hlo)]


def while_body_computations(hlo: str) -> list[list[str]]:
    """The instruction lines of every while body and of everything they call (fusions too)."""
    comps = computations(hlo)
    bodies = while_bodies(hlo)
    assert bodies, "the compiled program has no while loop"
    seen, stack = set(), list(bodies)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for group in CALLED.findall(line):
                stack.extend(n.strip().lstrip("%") for n in group.split(",") if n.strip())
    return [comps[name] for name in sorted(seen)]


def largest_loop_body(hlo: str, *, metadata: bool = False) -> list[str]:
    """The instructions of the program's largest while body (for `generate`, the decoding loop's
    step: prefill and the loop's set-up run once, outside it), or [] without a loop."""
    comps = computations(hlo, metadata=metadata)
    return max((comps[b] for b in while_bodies(hlo) if b in comps), key=len, default=[])


def launched(lines: list[str]) -> int:
    """How many of a computation's instructions launch work (a fusion counts once): about one
    kernel each on a GPU."""
    return sum(INSTRUCTION.match(line).group("op") not in FREE for line in lines)


def kernel_name(instruction: str) -> str:
    """The kernel XLA:GPU launches for an instruction (`loop_transpose_fusion.761` ->
    `loop_transpose_fusion_761`)."""
    return re.sub(r"[.\-]", "_", instruction)

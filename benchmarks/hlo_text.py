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
LOOP_OP_NAME = re.compile(r'op_name="[^"]*?/while/body/([^"]*)"')
# The scopes spec_jax's loop step names (`jax.named_scope` in spec_jax/decoding/loop.py and the
# drafters); the loop's other code is "loop".
STEP_SCOPES = ("draft", "verify", "accept", "dflash_context", "draw_keys")
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


BRANCHES = re.compile(r"(?:branch_computations=\{([%\w.\-, ]+)\}|true_computation=%?([\w.\-]+), "
                      r"false_computation=%?([\w.\-]+))")


def switch_branches_launched(hlo: str) -> list[list[int]]:
    """For each conditional (`lax.switch` / `lax.cond`) in the largest loop body, what each of its
    branches launches (`launched` over the branch and the computations it calls, a fusion once):
    the loop body's own count leaves them out, and the layers' cache attention lives in them."""
    comps = computations(hlo)

    def launched_in(name: str) -> int:
        total = 0
        for line in comps.get(name, []):
            op = INSTRUCTION.match(line).group("op")
            total += op not in FREE
            if op in ("call", "while"):  # their bodies launch the work (a while's body counted once)
                total += sum(launched_in(n.strip().lstrip("%")) for group in CALLED.findall(line)
                             for n in group.split(",") if n.strip())
        return total

    out = []
    for line in largest_loop_body(hlo):
        found = BRANCHES.search(line) if " conditional(" in line else None
        if found:
            names = found.group(1).split(",") if found.group(1) else [found.group(3), found.group(2)]
            out.append([launched_in(n.strip().lstrip("%")) for n in names])
    return out


def loop_scope(line: str) -> str | None:
    """The step scope an instruction line (metadata kept) came from: one of STEP_SCOPES, "loop"
    for the loop's other code, None outside the loop (prefill, set-up) or without metadata."""
    found = LOOP_OP_NAME.search(line)
    if not found:
        return None
    parts = [p for p in found.group(1).split("/") if not p.startswith(("jit(", "closed_call"))]
    return parts[0] if parts and parts[0] in STEP_SCOPES else "loop"


def launched_by_scope(body: list[str]) -> dict[str, int]:
    """`launched` by `loop_scope`, for a loop body's lines (metadata kept): an instruction XLA made
    without a JAX op name (a copy, a layout change) counts as "loop"."""
    counts: dict[str, int] = {}
    for line in body:
        if INSTRUCTION.match(line).group("op") not in FREE:
            scope = loop_scope(line) or "loop"
            counts[scope] = counts.get(scope, 0) + 1
    return counts


def kernel_scope_shares(hlo: str) -> dict[str, dict[str, float]]:
    """Kernel name -> {loop step scope: its share of the kernel's launches}, for every kernel
    launched by an instruction of the program inside the loop (library calls such as cuBLAS's
    GEMMs name their kernels their own way and are not found).

    XLA:GPU compiles one kernel for fusions with the same body and launch, and names it after the
    first of them: in a DFlash chain the drafter's layers and the target's run the same GEMMs at
    the block's width, so the target's kernels can carry a drafter fusion's name (the H100 profile
    of session 34 put the chain's verify pass in "draft"). So a kernel's launches are shared out
    over the scopes of all its twins (`fusion_key`), one share per twin inside the loop."""
    comps = computations(hlo, metadata=True)
    bare = {name: [METADATA.sub("", line) for line in lines] for name, lines in comps.items()}
    fused = {called.group(1) for lines in comps.values() for line in lines
             if INSTRUCTION.match(line).group("op") == "fusion"
             for called in [re.search(r"calls=%?([\w.\-]+)", line)] if called}
    twins: dict[str, list[tuple[str, str | None]]] = {}  # key -> [(kernel, scope)]
    for name, lines in comps.items():
        if name in fused:  # a fusion's body: its instructions are not launched one by one
            continue
        for line in lines:
            instruction = INSTRUCTION.match(line)
            if instruction.group("op") not in FREE:
                twins.setdefault(fusion_key(METADATA.sub("", line), bare), []).append(
                    (kernel_name(instruction.group("name")), loop_scope(line)))
    shares: dict[str, dict[str, float]] = {}
    for members in twins.values():
        scopes = [scope for _, scope in members if scope is not None]
        for kernel, _ in members:
            if scopes:
                shares[kernel] = {scope: scopes.count(scope) / len(scopes) for scope in dict.fromkeys(scopes)}
    return shares


NAME = re.compile(r"%[\w.\-]+")


def fusion_key(line: str, bare: dict[str, list[str]]) -> str:
    """What makes two instructions launch the same kernel: for a fusion, its line and its body's
    lines with every name replaced by the order it first appears in (operands, the fused
    computation, its parameters); anything else is its own (its name)."""
    instruction = INSTRUCTION.match(line)
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if instruction.group("op") != "fusion" or not called:
        return instruction.group("name")
    seen: dict[str, int] = {}
    text = "\n".join([line.split(" = ", 1)[1], *bare.get(called.group(1), [])])
    return NAME.sub(lambda m: f"%{seen.setdefault(m.group(0), len(seen))}", text)


def kernel_name(instruction: str) -> str:
    """The kernel XLA:GPU launches for an instruction (`loop_transpose_fusion.761` ->
    `loop_transpose_fusion_761`)."""
    return re.sub(r"[.\-]", "_", instruction)

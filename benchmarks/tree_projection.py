"""Chains against token trees from a `spec-jax bench` run, with the speed an H100 would give.

Reads the bench's results.json (e.g. `spec-jax bench --drafters dflash,dflash+ngram --k 7
--tree 0,7,16,32 --out DIR`) and prints, per method: the verify width, tau, the measured CPU
tokens/s and speedup, the CPU time per step, and a projected H100 speedup over plain decoding:

    projected speedup = tau / (v(verify tokens) + d)

where v(T) is the cost of a T-token verify pass relative to one token, measured on an H100
(DESIGN.md / README: 16 tokens 0.94-1.03x, 64 tokens 1.01-1.09x; bf16, Llama-3.2-1B and Qwen3-8B
shapes; linear in between, 1.0 at one token), and d the drafter's pass relative to a target step
(`--draft-cost`, an assumption, not a measurement: the default 0.3 is the shipped DFlash drafter's
3 layers of the target's 30 plus its LM head over the block, which reads the same 28M-parameter
head as the target's step). Tau does not depend on the backend under greedy decoding, so the
projection differs from a GPU measurement only through v and d. Writes tree_projection.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Verify cost on an H100 relative to one token (the midpoints of the measured ranges).
H100_VERIFY_COST = ((1, 1.0), (16, 0.985), (64, 1.05))


def verify_cost(tokens: int) -> float:
    points = H100_VERIFY_COST
    for (t0, c0), (t1, c1) in zip(points, points[1:]):
        if tokens <= t1:
            return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
    return points[-1][1]


def projection(report: dict, draft_cost: float) -> list[dict]:
    rows = []
    for r in report["results"]:
        drafted = r["k"] > 0
        verify = r.get("verify_tokens", r["k"] + 1)
        projected = r["tau"] / (verify_cost(verify) + (draft_cost if drafted else 0.0))
        rows.append({
            "method": r["method"], "k": r["k"], "tree": r.get("tree", 0), "verify_tokens": verify,
            "tau": r["tau"], "cpu_tok_s": r["tokens_per_second"], "cpu_speedup": r["speedup"],
            "cpu_ms_per_step": 1000 * r["generate_s"] / r["steps"] if r["steps"] else 0.0,
            "h100_projected_speedup": projected,
            "depth_acceptance": r.get("depth_acceptance"),
        })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a bench results.json")
    p.add_argument("--draft-cost", type=float, default=0.3,
                   help="the drafter's pass relative to a target step on the GPU (an assumption)")
    p.add_argument("--out", default=None, help="where to write tree_projection.png (default: beside results)")
    args = p.parse_args()
    report = json.loads(Path(args.results).read_text())
    rows = projection(report, args.draft_cost)
    print("| method | K | tree | verify tokens | tau | CPU tok/s | CPU speedup | CPU ms/step | H100 projected speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['k']} | {r['tree'] or '-'} | {r['verify_tokens']} | {r['tau']:.2f} | "
              f"{r['cpu_tok_s']:.1f} | {r['cpu_speedup']:.2f}x | {r['cpu_ms_per_step']:.1f} | "
              f"{r['h100_projected_speedup']:.2f}x |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    def line(r):  # the chain (one point) apart from the trees of the same drafter
        return r["method"] + (" trees" if r["tree"] else " chain")

    for name in dict.fromkeys(line(r) for r in rows if r["k"]):
        pts = sorted(((r["verify_tokens"], r) for r in rows if r["k"] and line(r) == name), key=lambda p: p[0])
        xs = [x for x, _ in pts]
        style = dict(marker="s" if name.endswith("chain") else "o", label=name,
                     linestyle="none" if len(xs) == 1 else "-")
        axes[0].plot(xs, [r["tau"] for _, r in pts], **style)
        axes[1].plot(xs, [r["cpu_speedup"] for _, r in pts], **style)
        axes[2].plot(xs, [r["h100_projected_speedup"] for _, r in pts], **style)
    for ax, title in zip(axes, ["tau (tokens per target pass)", "CPU speedup over AR (measured)",
                                f"H100 speedup over AR (projected, d={args.draft_cost})"]):
        ax.set_xlabel("tokens per verify pass (chain K+1 = 8; trees N+1)")
        ax.set_title(title)
        ax.legend(fontsize="small")
    axes[1].axhline(1.0, color="gray", linestyle="--")
    axes[2].axhline(1.0, color="gray", linestyle="--")
    fig.suptitle(f"{report['target']} | {report['prompt_set']} | batch {report['batch_size']} | "
                 f"{report['max_new_tokens']} tokens", fontsize="small")
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.results).parent / "tree_projection.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Held-out tau against training data, from the training logs recorded in this directory.

    python benchmarks/training/tau_vs_data.py   # prints the table, writes tau_vs_data.png

Each run named below continued from the one before it (`--init-from`), so the curves are the shipped
DFlash drafter's history: the data each run trained on, its steps, and the held-out tau of its
evaluations (HumanEval[:40], 64 tokens, greedy; the evaluation `spec-jax train` runs). The left
panel is tau against each run's data; the right one every evaluation against the steps trained so
far (later runs on the same data add steps, not data). Branches (crosses, dashed) started from a
run of the chain and were not kept: they record what other data did from the same starting point.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
# In the order they continued each other:
RUNS = ("dflash_finetune", "dflash_ft2", "dflash_full", "dflash_full2", "dflash_3l", "dflash_kl", "dflash_kl3",
        "dflash_kl4")
# Runs that continued a run above and were not kept: run -> the run they started from.
BRANCHES = {
    "dflash_text": "dflash_3l",  # standard-library source, teacher labels, no generation
    "dflash_lowlr": "dflash_kl4",  # the same data, 1000 steps at peak rate 1e-4 instead of 3e-4
    "dflash_b16": "dflash_kl4",  # block 16 (its tau is at K=15), 3000 sequences of the same mix
}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for run in RUNS + tuple(BRANCHES):
        log_file = HERE / run / "training_log.json"
        if not log_file.exists():
            print(f"{run}: no training_log.json (not recorded)")
            continue
        log = json.loads(log_file.read_text())
        last = log["evals"][-1]
        rows.append({
            "run": run, "data_tokens": log["data_tokens"], "sequences": log["data_sequences"],
            "steps": log["train"]["steps"], "draft_vocab": log.get("draft_vocab_size") or "full",
            "tau": last["tau"], "evals": log["evals"], "branch_of": BRANCHES.get(run),
            "labels": ("target argmax" if log.get("teacher_labels") else "data")
            + (f" + KL x{log['kl_weight']:g}" if log.get("kl_weight") else ""),
        })
    print("| run | continues | data tokens | sequences | labels | steps | draft vocab | held-out tau (last eval) |")
    print("|---|---|---:|---:|---|---:|---|---:|")
    for i, r in enumerate(rows):
        parent = r["branch_of"] or (rows[i - 1]["run"] if i and not rows[i - 1]["branch_of"] else "-")
        print(f"| {r['run']} | {parent} | {r['data_tokens']:,} | {r['sequences']} | {r['labels']} | {r['steps']} "
              f"| {r['draft_vocab']} | {r['tau']:.2f} |")

    chain = [r for r in rows if not r["branch_of"]]
    fig, (ax, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot([r["data_tokens"] for r in chain], [r["tau"] for r in chain], marker="o")
    for r in rows:
        if r["branch_of"]:
            ax.plot([r["data_tokens"]], [r["tau"]], "x", color="C3")
        ax.annotate(f"{r['run']}\n{r['steps']} steps", (r["data_tokens"], r["tau"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -14))
    ax.set_xscale("log")
    ax.set_xlabel("tokens in the run's training data")
    ax.set_ylabel("held-out tau (HumanEval[:40], K=7)")
    ax.set_title("DFlash (SmolLM2-135M): held-out tau against data")
    ax.grid(alpha=0.3)
    done, ends = 0, {}
    for r in chain:
        by_step.plot([done + e["step"] for e in r["evals"]], [e["tau"] for e in r["evals"]], "o-",
                     label=f"{r['run']} ({r['data_tokens'] / 1e6:.2f}M tokens)")
        done += r["steps"]
        ends[r["run"]] = (done, r["tau"])
    for r in rows:
        if r["branch_of"] in ends:  # dashed, from the point it started at
            start, tau0 = ends[r["branch_of"]]
            by_step.plot([start] + [start + e["step"] for e in r["evals"]], [tau0] + [e["tau"] for e in r["evals"]],
                         "x--", label=f"{r['run']} ({r['data_tokens'] / 1e6:.2f}M tokens, {r['labels']} labels; not kept)")
    by_step.set_xlabel("steps since dflash_finetune began (batch 8 x 8 anchors)")
    by_step.set_title("every held-out evaluation")
    by_step.legend(fontsize=7)
    by_step.grid(alpha=0.3)
    fig.tight_layout()
    out = HERE / "tau_vs_data.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Held-out tau against training data, from the training logs recorded in this directory.

    python benchmarks/training/tau_vs_data.py   # prints the table, writes tau_vs_data.png

Each run named below continued from the one before it (`--init-from`), so the curves are the shipped
DFlash drafter's history: the data each run trained on, its steps, and the held-out tau of its
evaluations (HumanEval[:40], 64 tokens, greedy; the evaluation `spec-jax train` runs). The left
panel is tau against each run's data; the right one every evaluation against the steps trained so
far (later runs on the same data add steps, not data).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
RUNS = ("dflash_finetune", "dflash_ft2", "dflash_full", "dflash_full2", "dflash_3l")  # in the order they continued each other


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for run in RUNS:
        log_file = HERE / run / "training_log.json"
        if not log_file.exists():
            print(f"{run}: no training_log.json (not recorded)")
            continue
        log = json.loads(log_file.read_text())
        last = log["evals"][-1]
        rows.append({
            "run": run, "data_tokens": log["data_tokens"], "sequences": log["data_sequences"],
            "steps": log["train"]["steps"], "draft_vocab": log.get("draft_vocab_size") or "full",
            "tau": last["tau"], "evals": log["evals"],
        })
    print("| run | data tokens | sequences | steps | draft vocab | held-out tau (last eval) |")
    print("|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['data_tokens']:,} | {r['sequences']} | {r['steps']} | {r['draft_vocab']} | {r['tau']:.2f} |")

    fig, (ax, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot([r["data_tokens"] for r in rows], [r["tau"] for r in rows], marker="o")
    for r in rows:
        ax.annotate(f"{r['run']}\n{r['steps']} steps", (r["data_tokens"], r["tau"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -14))
    ax.set_xscale("log")
    ax.set_xlabel("tokens in the run's training data")
    ax.set_ylabel("held-out tau (HumanEval[:40], K=7)")
    ax.set_title("DFlash (SmolLM2-135M): held-out tau against data")
    ax.grid(alpha=0.3)
    done = 0
    for r in rows:
        by_step.plot([done + e["step"] for e in r["evals"]], [e["tau"] for e in r["evals"]], "o-",
                     label=f"{r['run']} ({r['data_tokens'] / 1e6:.2f}M tokens)")
        done += r["steps"]
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

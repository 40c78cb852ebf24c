"""Per-step adaptive depth (`generate(..., k="adaptive")`) against plain decoding and the fixed
default K, one prompt at a time (batch 1), greedy, on chat prompts and on HumanEval prompts.

Loads the default model and the default drafter for batch 1 (`spec_jax.default_drafter`), a chain
(--tree 0 for every method, so only the depth policy differs). For each prompt, runs plain
decoding, the drafter at its fixed K, and the drafter with `k="adaptive"` (costs measured once on
the first prompt and reused: `spec_jax.decoding.depth_costs`), --repeats times, the order of the
three reversed on every other pass (the shared machine's load drifts); reports the median
tokens/s per method and prompt, the speedups over plain, and the adaptive policy's steps per
depth. Compiles and the one cost measurement are not timed. Every greedy output is checked
token-equal to plain decoding. `--temperature 0.7` samples instead, with the default drafter for
that temperature (repeat r uses seed r for every method).

    python benchmarks/adaptive_depth.py --max-new-tokens 64 --repeats 3 --out benchmarks/results/adaptive_depth

`--drafters dflash+ngram,draft-model+ngram@2,ngram` compares drafter kinds instead (the mixed-workload
table behind `spec_jax/assets/measured_defaults.json`): plain decoding and each drafter with
`k="adaptive"` (the depths 0, 2, ~K/2 and K of the drafter's own K, or of @K), each with its own
measured depth costs, the methods' order rotated on every repeat; `--fixed` adds each at its fixed K,
`--trees 0,16` each at each tree budget.

`--random-drafter` takes the default drafter's model part alone (no prompt lookup) and re-draws its
weights (same shapes, normal * 0.02; vectors kept), so it never gets a draft accepted: the adaptive policy's floor against plain decoding (issue 41's
">= 0.95x" bar). `--batch N` runs N prompts per call (the list cycled), the rows' tokens summed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chat", type=int, default=4, help="chat prompts (the first N of assets/chat_prompts.json)")
    p.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts (the first N)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--batch", type=int, default=1, help="prompts per generate call (default 1)")
    p.add_argument("--units", type=int, default=None,
                   help="with --batch: calls per prompt kind (default: one per prompt, each starting at it)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (every output checked token-equal to plain decoding); above: sampled, "
                        "the default drafter for that temperature (exactness: tests/test_sampling_stats.py)")
    p.add_argument("--drafters", default=None,
                   help="compare these drafters (comma list as `spec-jax bench --drafters` takes them, "
                        "NAME@K for a largest depth K), each adaptive, instead of the default drafter")
    p.add_argument("--fixed", action="store_true", help="with --drafters: each drafter at its fixed K too")
    p.add_argument("--trees", default="0",
                   help="with --drafters: comma list of tree budgets for each drafter (0: a chain, the default)")
    p.add_argument("--random-drafter", action="store_true",
                   help="the default drafter's shapes with random weights: never accepted")
    args = p.parse_args()

    from spec_jax.app import compilation_cache

    compilation_cache.configure(None)  # the command line's persistent cache: a rerun loads its programs
    from spec_jax import default_drafter, generate, load_target
    from spec_jax.app.bench import chat_prompts
    from spec_jax.checkpoints import apply_chat_template
    from spec_jax.decoding.generate import with_tree
    from spec_jax.humaneval import humaneval_problems

    target = load_target(None, dtype="float32")
    drafter, drafter_params, _ = default_drafter(target, batch_size=args.batch, temperature=args.temperature)
    drafter = with_tree(drafter, 0)
    if args.random_drafter:  # the model drafter alone (prompt lookup would get copies accepted)
        import jax

        drafter = dataclasses.replace(drafter.model, k=drafter.k) if hasattr(drafter, "model") else drafter

        leaves, tree = jax.tree_util.tree_flatten(drafter_params)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        drafter_params = jax.tree_util.tree_unflatten(tree, [
            (0.02 * jax.random.normal(k, x.shape)).astype(x.dtype) if getattr(x, "ndim", 0) >= 2 else x
            for k, x in zip(keys, leaves)])

    def chat(text):
        return apply_chat_template(target.tokenizer, [{"role": "user", "content": text}], target.chat_template)

    prompts = [("chat", p.text, chat(p.text)) for p in chat_prompts(args.chat)]
    prompts += [("humaneval", prob["task_id"], chat("Complete this Python function:\n" + prob["prompt"]))
                for prob in humaneval_problems()[: args.humaneval]]
    if args.batch > 1:  # each unit: `batch` prompts of one kind, that kind's list cycled
        units = []
        for kind in ("chat", "humaneval"):
            part = [q for q in prompts if q[0] == kind]
            units += [(kind, part[i][1], [part[(i + j) % len(part)][2] for j in range(args.batch)])
                      for i in range(len(part))][: args.units]
        prompts = units
    else:
        prompts = [(kind, label, [ids]) for kind, label, ids in prompts]
    if args.drafters:
        methods = {"plain": dict(drafter=None, drafter_params=None)}
        trees = [int(t) for t in args.trees.split(",")]
        methods.update(drafter_methods(target, args.drafters, fixed=args.fixed, trees=trees))
    else:
        methods = {
            "plain": dict(drafter=None, drafter_params=None),
            f"fixed K={drafter.k}": dict(drafter=drafter, drafter_params=drafter_params),
            "adaptive": dict(drafter=drafter, drafter_params=drafter_params, k="adaptive"),
        }
    common = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=args.temperature)
    costs = {}
    for name, kw in methods.items():  # compile, and measure the depth costs once
        r = generate(target, prompts[0][2], **kw, **common)
        print(f"warm-up {name}: compile {r.compile_s:.1f}s", flush=True)
        if r.depth_costs is not None:
            costs[name] = r.depth_costs
            print(f"{name} depth costs (s per step at depths 0, 2, ~K/2, K): {r.depth_costs}", flush=True)

    rows = []
    for kind, label, ids in prompts:
        speeds = {name: [] for name in methods}
        outputs, depth_counts, shadows, taus = {}, {}, {}, {}
        for rep in range(args.repeats):
            order = rotated(list(methods), rep)
            for name in order:
                r = generate(target, ids, **methods[name], **common, seed=rep)
                speeds[name].append(r.tokens_per_second)
                outputs[name] = r.generated_ids
                if r.depth_counts is not None:
                    depth_counts[name], shadows[name] = r.depth_counts, r.shadow_probes
                if name != "plain":
                    taus[name] = r.stats.tau
        medians = {name: statistics.median(v) for name, v in speeds.items()}
        row = dict(kind=kind, prompt=label[:48], tokens_per_s=medians,
                   speedup={n: medians[n] / medians["plain"] for n in methods if n != "plain"},
                   exact={n: outputs[n] == outputs["plain"] if args.temperature == 0 else None
                          for n in methods if n != "plain"},
                   steps_per_depth=depth_counts, shadow_probes=shadows, tau=taus)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{'kind':10} {'prompt':50} " + " ".join(f"{n:>24}" for n in methods if n != "plain"))
    for row in rows:
        print(f"{row['kind']:10} {row['prompt']:50} " + " ".join(f"{s:>23.2f}x" for s in row["speedup"].values()))
        for name, counts in row["steps_per_depth"].items():
            print(f"{'':61} {name}: steps per depth {counts}")
    summary = summarize(rows)
    for kind, per_method in summary.items():
        print(f"over {kind}: " + ", ".join(f"{n} median {v['median']:.2f}x mean {v['mean']:.2f}x"
                                           for n, v in per_method.items()))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"costs": costs, "temperature": args.temperature,
                                                      "batch": args.batch, "rows": rows, "summary": summary},
                                                     indent=1) + "\n")
        plot(rows, out / "adaptive_depth.png",
             f"batch {args.batch}, T = {args.temperature:g}, {args.max_new_tokens} tokens")


def summarize(rows: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per prompt half (chat, humaneval) and both together ("mixed"): each method's median and mean
    speedup over plain decoding across prompts."""
    summary = {}
    for kind in ("chat", "humaneval", "mixed"):
        part = [r for r in rows if kind in ("mixed", r["kind"])]
        if part:
            summary[kind] = {n: {"median": statistics.median(r["speedup"][n] for r in part),
                                 "mean": statistics.mean(r["speedup"][n] for r in part)}
                             for n in part[0]["speedup"]}
    return summary


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Each method's speedup over plain decoding per prompt (dots) and its median (bar), the chat
    and HumanEval halves side by side, with 1.0x (plain decoding) drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(rows[0]["speedup"])
    kinds = [k for k in ("chat", "humaneval") if any(r["kind"] == k for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(methods)), 4.5))
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        part = [r for r in rows if r["kind"] == kind]
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(methods))]
        medians = [statistics.median(r["speedup"][m] for r in part) for m in methods]
        ax.bar(xs, medians, width * 0.9, label=f"{kind} (median of {len(part)})", alpha=0.6)
        for x, m in zip(xs, methods):
            ax.plot([x] * len(part), [r["speedup"][m] for r in part], "k.", markersize=4)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(methods)), [m.replace(" adaptive", "\nadaptive") for m in methods], fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"Default model, {title}: per prompt (dots), median (bars)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rotated(names: list[str], rep: int) -> list[str]:
    """The methods' order for repeat `rep`: plain, the default's fixed K and adaptive reversed on odd
    repeats (three methods), or rotated by one per repeat (more), so each runs early and late."""
    if len(names) <= 3:
        return names if rep % 2 == 0 else list(reversed(names))
    shift = rep % len(names)
    return names[shift:] + names[:shift]


def drafter_methods(target, text: str, fixed: bool, trees: list[int]) -> dict[str, dict]:
    """--drafters: name -> generate kwargs, each drafter adaptive (and at its fixed K with --fixed),
    at each tree budget (0: a chain)."""
    from spec_jax.app.inputs import build_drafter, parse_drafter_spec

    methods = {}
    for item in text.split(","):
        item, _, k = item.strip().partition("@")
        for tree in trees:
            spec = dataclasses.replace(parse_drafter_spec(item, int(k) if k else None), tree=tree)
            drafter, params = build_drafter(spec, target)
            label = f"{item} K={drafter.k}" + (f" tree={tree}" if tree else "")
            if fixed:
                methods[f"{label} fixed"] = dict(drafter=drafter, drafter_params=params)
            methods[f"{label} adaptive"] = dict(drafter=drafter, drafter_params=params, k="adaptive")
    return methods


if __name__ == "__main__":
    main()

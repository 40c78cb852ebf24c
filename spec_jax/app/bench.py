"""`spec-jax bench`: the autoregressive baseline against drafters on the same prompts.

    from spec_jax.app import bench, inputs
    target = inputs.load_target_or_fail(None)
    prompts = inputs.encode_prompts(target, bench.humaneval_prompts(10))
    methods = bench.expand_methods([inputs.parse_drafter_spec("ngram")], ks=[2, 4, 8])
    report = bench.run_bench(target, prompts, methods, max_new_tokens=128)
    bench.print_table(report); bench.write_outputs(report, "bench_out")

Every method runs the same batches. Each method is warmed up first (one untimed run of the first
batch, which compiles the loop); `generate` reports compile time apart from run time, so a batch
with a new prompt bucket that compiles mid-run does not count its compile either. Under greedy
sampling every drafter's output must equal AR's token for token; mismatches are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

from spec_jax.app import inputs
from spec_jax.app.common import (
    add_prompt_args,
    add_sampling_args,
    add_target_args,
    collect_prompts,
    emit,
    log,
    parse_positive_ints,
    sampling_kwargs,
)
from spec_jax.app.inputs import DrafterSpec, Prompt, build_drafter
from spec_jax.checkpoints import LoadedModel
from spec_jax.decoding.loop import tree_budget
from spec_jax.drafters import registry
from spec_jax.humaneval import humaneval_problems

AR = DrafterSpec("none")


def humaneval_prompts(num_prompts: int) -> list[Prompt]:
    """The first `num_prompts` HumanEval prompts (function signature + docstring) as user messages."""
    return [Prompt(text=p["prompt"], source=p["task_id"]) for p in humaneval_problems()[:num_prompts]]


def chat_prompts(num_prompts: int) -> list[Prompt]:
    """The first `num_prompts` general chat prompts (stories, explanations, recipes, lists, emails:
    not code) shipped in spec_jax/assets/chat_prompts.json, as user messages."""
    from importlib.resources import files

    data = json.loads(files("spec_jax").joinpath("assets/chat_prompts.json").read_text())
    return [Prompt(text=p["text"], source=p["id"]) for p in data["prompts"][:num_prompts]]


PROMPT_SETS = {"humaneval": humaneval_prompts, "chat": chat_prompts}


def expand_methods(
    specs: Sequence[DrafterSpec], ks: Sequence[int | str | None], trees: Sequence[int | None] = (None,)
) -> list[DrafterSpec]:
    """AR first, then every drafter at every K and tree budget (duplicates dropped)."""
    methods = [AR]
    for spec in specs:
        for k in ks:
            for tree in trees:
                if k == "adaptive":  # the drafter's own K the largest depth, a chain unless --tree
                    method = dataclasses.replace(spec, k=None, tree=tree or 0, adaptive=True)
                else:
                    method = dataclasses.replace(spec, k=k, tree=tree)
                if method not in methods:
                    methods.append(method)
    return methods


def _batches(n: int, batch_size: int) -> list[range]:
    return [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def run_bench(
    target: LoadedModel,
    prompt_ids: Sequence[Sequence[int]],
    methods: Sequence[DrafterSpec],
    *,
    batch_size: int = 1,
    progress: bool = True,
    extra_generate_kwargs: dict[str, Any] | None = None,
    prompt_set: str = "",
    **request_values: Any,
) -> dict[str, Any]:
    """Run every method over all prompts; return a JSON-ready report (see `print_table`).

    request_values: max_new_tokens (default 128), temperature, top_k, top_p, seed, stop_ids and
    ignore_eos, as `generate` takes them; checked once here, before any drafter loads."""
    from tqdm import tqdm

    from spec_jax.decoding.generate import default_stop_ids, generate
    from spec_jax.decoding.validation import check_request_values

    values = check_request_values(default_stop_ids(target), **request_values)
    if not methods or methods[0] != AR:
        methods = [AR] + [m for m in methods if m != AR]
    batches = _batches(len(prompt_ids), batch_size)
    kwargs = dict(request_values, **(extra_generate_kwargs or {}))
    # Build (and load) every drafter before timing anything, so a bad checkpoint fails fast.
    built = [(m, *build_drafter(m, target)) for m in methods]
    greedy = values.temperature <= 0
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(methods) * len(batches), desc="bench", file=sys.stderr, disable=not progress)
    names = _method_names([m for m, drafter, _ in built if drafter is not None])
    for method, drafter, drafter_params in built:
        name = "AR" if drafter is None else names[method] + (" adaptive" if method.adaptive else "")
        bar.set_postfix_str(f"{name} warm-up")
        depth = {"k": method.generate_k} if method.adaptive else {}
        warm = generate(target, [prompt_ids[i] for i in batches[0]], drafter, drafter_params, **kwargs, **depth)
        bar.set_postfix_str(name)
        runs = []
        for batch in batches:
            runs.append(generate(target, [prompt_ids[i] for i in batch], drafter, drafter_params, **kwargs,
                                 **depth))
            bar.update(1)
        row = _method_row(name, method, drafter, warm, runs)
        if drafter is not None and greedy and rows:  # rows[0] is AR's
            ar_outputs = rows[0]["generated_ids"]
            row["mismatches"] = [_mismatch(i, a, b) for i, (a, b)
                                 in enumerate(zip(ar_outputs, row["generated_ids"])) if a != b]
        rows.append(row)
    bar.close()
    ar_tps = rows[0]["tokens_per_second"]
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / ar_tps if ar_tps > 0 else 0.0
    return {
        "target": target.source,
        "prompt_set": prompt_set,
        "num_prompts": len(prompt_ids),
        "batch_size": batch_size,
        "max_new_tokens": values.max_new_tokens,
        "sampling": {"temperature": values.temperature, "top_k": values.top_k, "top_p": values.top_p,
                     "seed": values.seed},
        "greedy": greedy,
        "machine": _machine(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "results": rows,
    }


def _method_row(name: str, method: DrafterSpec, drafter: Any, warm: Any, runs: Sequence[Any]) -> dict[str, Any]:
    """One method's report row from its warm-up run and its runs over every batch."""
    outputs = [ids for result in runs for ids in result.generated_ids]
    finish = [reason for result in runs for reason in result.finish_reasons]
    totals = None
    for result in runs:
        totals = _add_stats(totals, result.stats.to_dict())
    generate_s = sum(result.generate_s for result in runs)
    tokens = sum(len(o) for o in outputs)
    k = 0 if drafter is None else int(drafter.k)
    tree = tree_budget(drafter)
    steps, hist = totals["steps"], totals["acceptance_histogram"]
    return {
        "method": name,
        "drafter": method.kind,
        "path": method.path,
        "k": k,
        "tree": tree,  # draft nodes per step (0 = a chain of K)
        "verify_tokens": (tree or k) + 1,
        "tokens": tokens,
        "generate_s": generate_s,
        "tokens_per_second": tokens / generate_s if generate_s > 0 else 0.0,
        "compile_s": warm.compile_s + sum(result.compile_s for result in runs),
        "warmup_run_s": warm.generate_s,
        "steps": totals["steps"],
        "drafted": totals["drafted"],
        "accepted": totals["accepted"],
        "tau": totals["emitted"] / totals["steps"] if totals["steps"] else 0.0,
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
        "acceptance_histogram": hist,
        # Per depth d = 1..K: the share of steps that accepted a draft at depth d.
        "depth_acceptance": [sum(hist[d:]) / steps if steps else 0.0 for d in range(1, len(hist))],
        "finish_reasons": {r: finish.count(r) for r in sorted(set(finish))},
        "generated_ids": outputs,
        **_depth_counts(runs),
    }


def _depth_counts(runs: Sequence[Any]) -> dict[str, Any]:
    """--k adaptive: {"depth_counts": steps taken at each depth over the runs}; else {}."""
    if runs[0].depth_counts is None:
        return {}
    counts: dict[int, int] = {}
    for result in runs:
        for depth, steps in result.depth_counts.items():
            counts[depth] = counts.get(depth, 0) + steps
    return {"depth_counts": dict(sorted(counts.items()))}


def _method_names(methods: list[Any]) -> dict[Any, str]:
    """kind:dir-name per method; kind:parent/dir-name where dir names repeat (two runs' `drafter/`)."""
    def name(method: Any, parts: int) -> str:
        if not method.path:
            return method.kind
        return f"{method.kind}:" + "/".join(Path(method.path).parts[-parts:])

    short = [name(m, 1) for m in methods]
    return {m: name(m, 2) if short.count(n) > 1 else n for m, n in zip(methods, short)}


def _add_stats(acc: dict[str, Any] | None, stats: dict[str, Any]) -> dict[str, Any]:
    if acc is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in stats.items()}
    for key in ("steps", "drafted", "accepted", "emitted"):
        acc[key] += stats[key]
    acc["acceptance_histogram"] = [a + b for a, b in zip(acc["acceptance_histogram"], stats["acceptance_histogram"])]
    return acc


def _mismatch(index: int, reference: list[int], other: list[int]) -> dict[str, int]:
    first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    return {"prompt": index, "first_difference": first, "ar_length": len(reference), "length": len(other)}


def _machine() -> str:
    import jax

    devices = jax.devices()
    return f"{platform.node()} {platform.machine()} {devices[0].platform} x{len(devices)} ({devices[0].device_kind})"


def _histogram_text(hist: Sequence[int]) -> str:
    total = sum(hist)
    if not total:
        return "-"
    return " ".join(f"{100 * h / total:.0f}" for h in hist)


def print_table(report: dict[str, Any], file=None) -> None:
    """A table (rich when available) of tokens/s, speedup, tau, acceptance histogram, exactness;
    one per prompt set for `--prompt-set both`."""
    file = file or sys.stdout
    if "prompt_sets" in report:
        for one in report["prompt_sets"]:
            print_table(one, file)
        return
    header = ["method", "K", "tree", "tok/s", "speedup", "tau", "accept", "histogram % (0..K accepted)", "= AR"]
    lines = []
    for row in report["results"]:
        if "mismatches" in row:
            exact = "yes" if not row["mismatches"] else f"NO ({len(row['mismatches'])})"
        else:
            exact = "-" if row["k"] else "ref"
        lines.append([
            row["method"],
            str(row["k"]) if "depth_counts" not in row else f"adaptive<={row['k']}",
            str(row.get("tree", 0) or "-"),
            f"{row['tokens_per_second']:.1f}",
            f"{row['speedup']:.2f}x",
            f"{row['tau']:.2f}",
            f"{100 * row['acceptance_rate']:.0f}%" if row["k"] else "-",
            _histogram_text(row["acceptance_histogram"]) if row["k"] else "-",
            exact,
        ])
    title = (
        f"{report['target']} | {report['prompt_set']} ({report['num_prompts']} prompts) | batch "
        f"{report['batch_size']} | {report['max_new_tokens']} new tokens | "
        f"{'greedy' if report['greedy'] else 'T=' + str(report['sampling']['temperature'])}"
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title, file=file)
        widths = [max(len(r[i]) for r in [header] + lines) for i in range(len(header))]
        for r in [header] + lines:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=file)
    else:
        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="left" if h in ("method",) or h.startswith("hist") else "right")
        for r in lines:
            table.add_row(*r)
        Console(file=file, width=max(120, len(title) + 4)).print(table)
    compile_total = sum(r["compile_s"] for r in report["results"])
    print(f"compile (excluded from tok/s): {compile_total:.1f}s total; machine: {report['machine']}", file=file)
    for row in report["results"]:
        if "depth_counts" in row:
            steps = sum(row["depth_counts"].values())
            shares = ", ".join(f"K={d}: {100 * n / steps:.0f}%" for d, n in row["depth_counts"].items())
            print(f"{row['method']} adaptive: steps per depth {shares}", file=file)
    for row in report["results"]:
        for m in row.get("mismatches", []):
            print(
                f"MISMATCH {row['method']} K={row['k']}: prompt {m['prompt']} differs from AR at token "
                f"{m['first_difference']}",
                file=file,
            )


def write_outputs(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """results.json and bench.png (acceptance histograms; speedup against K) under out_dir; with
    several prompt sets, one bench-SET.png each."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    written = [json_path]
    for one in report.get("prompt_sets", [report]):
        name = "bench.png" if "prompt_sets" not in report else f"bench-{one['prompt_set'].split('[')[0]}.png"
        plot(one, out / name)
        written.append(out / name)
    return written


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafted = [r for r in report["results"] if r["k"]]
    fig, (ax_hist, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(drafted))
    for i, row in enumerate(drafted):
        hist = row["acceptance_histogram"]
        total = sum(hist) or 1
        xs = [x + (i - (len(drafted) - 1) / 2) * width for x in range(len(hist))]
        tree = f" tree={row['tree']}" if row.get("tree") else ""
        ax_hist.bar(xs, [h / total for h in hist], width=width, label=f"{row['method']} K={row['k']}{tree}")
    ax_hist.set_xlabel("drafts accepted per step")
    ax_hist.set_ylabel("fraction of steps")
    ax_hist.set_title("Acceptance histogram")
    if drafted:
        ax_hist.legend(fontsize="small")
    by_method: dict[str, list[tuple[int, float]]] = {}
    for row in (r for r in drafted if "depth_counts" not in r):  # chains and trees as two lines each
        name = row["method"] + (" tree" if row.get("tree") else "")
        by_method.setdefault(name, []).append((row.get("verify_tokens", row["k"] + 1), row["speedup"]))
    for name, points in by_method.items():
        points.sort()
        ax_speed.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    for row in report["results"]:  # adaptive depth is no one width: a level to compare the fixed Ks with
        if "depth_counts" in row:
            ax_speed.axhline(row["speedup"], linestyle=":", color="tab:red", label=f"{row['method']} (per step)")
    ax_speed.axhline(1.0, color="gray", linestyle="--", label="AR")
    ax_speed.set_xlabel("tokens per verify pass (K + 1, or tree nodes + 1)")
    ax_speed.set_ylabel("speedup over AR (tokens/s)")
    ax_speed.set_title("Speedup against the verify width")
    ax_speed.legend(fontsize="small")
    fig.suptitle(f"{report['target']} | {report['prompt_set']} | batch {report['batch_size']}", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- the command
HELP = "AR vs drafters: tokens/s, speedup, acceptance"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    add_prompt_args(p)
    p.add_argument("--num-prompts", type=int, default=10, help="first N prompts of each set (default 10)")
    p.add_argument("--prompt-set", choices=[*PROMPT_SETS, "both"], default="humaneval",
                   help="humaneval (code), chat (26 general requests: stories, explanations, lists, emails) or "
                   "both: one table (and plot) per set, since speculation pays very differently on each "
                   "(default humaneval)")
    p.add_argument(
        "--drafters",
        default="ngram",
        help=f"comma list of drafters: {registry.synopsis()}; KIND+ngram puts prompt lookup in front of a "
        f"model drafter ({', '.join(registry.lookup_names())}) (default ngram)",
    )
    p.add_argument("--k", default=None, help="comma list of K values to sweep, e.g. 2,4,8; 'adaptive' "
                   "adds the drafter's K with each step picking its depth (0, 2, ~K/2, K), e.g. 4,7,adaptive")
    p.add_argument(
        "--tree", default=None, metavar="N[,N..]",
        help="comma list of tree budgets (draft nodes per step) to sweep; 0 = a chain of K, e.g. 0,16,32 "
        "compares the chain with trees (K bounds a tree's depth)",
    )
    p.add_argument("--batch-size", type=int, default=1)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--out", default=None, metavar="DIR", help="write results.json and bench.png here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--roofline",
        action="store_true",
        help="instead of prompts: copy bandwidth, AR step vs the bandwidth floor, and the cost of "
        "verifying 1..64 tokens in one pass (uses --target, --dtype, --batch-size, --out; the AR "
        "step is timed over --max-new-tokens steps)",
    )
    p.add_argument("--context", type=int, default=256, help="roofline: tokens already in the cache")
    p.add_argument(
        "--verify-tokens", default="1,2,4,8,16,32,64", help="roofline: comma list of tokens per verify pass"
    )


def parse_ks(text: str) -> list[int | str]:
    """--k "4,7,adaptive" -> [4, 7, "adaptive"]."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    adaptive = [w for w in words if w.lower() == "adaptive"]
    numbers = ",".join(w for w in words if w.lower() != "adaptive")
    return (parse_positive_ints(numbers, "--k", "2,4,adaptive") if numbers else []) + ["adaptive"] * bool(adaptive)


def parse_tree_budgets(text: str) -> list[int]:
    try:
        budgets = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise inputs.UsageError(f"--tree {text!r} is not a comma list of integers, e.g. 0,16,32.") from None
    if not budgets or any(b < 0 for b in budgets):
        raise inputs.UsageError(f"--tree values must be integers >= 0 (0 = a chain), got {text!r}.")
    return budgets


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.roofline:
        from spec_jax.app import roofline

        return roofline.run_command(args)
    sampling = sampling_kwargs(args)
    ks = [None] if args.k is None else parse_ks(args.k)
    trees = [None] if args.tree is None else parse_tree_budgets(args.tree)
    kinds = [d.strip() for d in args.drafters.split(",") if d.strip()]
    specs = [inputs.parse_drafter_spec(d) for d in kinds if d != "none"]
    if args.batch_size < 1:
        raise inputs.UsageError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.prompt_file or args.prompt_ids:
        prompt_sets = {args.prompt_file or "--prompt-ids": collect_prompts(args, [])}
    else:
        if args.num_prompts < 1:
            raise inputs.UsageError(f"--num-prompts must be >= 1, got {args.num_prompts}.")
        names = list(PROMPT_SETS) if args.prompt_set == "both" else [args.prompt_set]
        prompt_sets = {f"{name}[:{args.num_prompts}]": PROMPT_SETS[name](args.num_prompts) for name in names}

    target = inputs.load_target_or_fail(args.target, args.dtype)
    log(f"loaded {target.source}")
    methods = expand_methods(specs, ks, trees)
    reports = [
        run_bench(
            target,
            inputs.encode_prompts(target, prompts, args.chat),
            methods,
            batch_size=args.batch_size,
            ignore_eos=args.ignore_eos,
            progress=not args.no_progress,
            extra_generate_kwargs=inputs.mesh_kwargs(args.mesh, target),
            prompt_set=prompt_set,
            **sampling,
        )
        for prompt_set, prompts in prompt_sets.items()
    ]
    if len(reports) == 1:
        return emit(args, reports[0], write_outputs, print_table)
    return emit(args, {"prompt_sets": reports}, write_outputs, print_table)

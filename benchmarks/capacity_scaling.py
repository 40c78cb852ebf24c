"""Decode cost against the KV cache's capacity and against the live length (issue 34).

    python benchmarks/capacity_scaling.py --out DIR                   # default model, float32, CPU
    python benchmarks/capacity_scaling.py --target random:qwen3-8b --dtype bfloat16 --batch 1,32 --out DIR

Three measurements, each for plain decoding (AR) and the default drafter, under each attention
path in --impls ("live": the backend's own choice, `spec_jax.models.attention.LIVE_ATTENTION`;
"dense": every cache slot, the reference and the path before issue 34; "blocks[:N]",
"buckets[:N]": one live path with N-slot blocks):

- capacity sweep: ms per token at about --live live tokens (prompt of live - new/2 tokens, then
  --new-tokens new ones) for each capacity in --capacities;
- live sweep: ms per token at capacity --live-capacity for prompts of each length in --lives;
- long: one generation of --long new tokens at the default capacity, end to end.

ms per token = (time for N new tokens - time for 1) / (N - 1), each time the best of --repeats
runs: the decode loop alone, without prefill and cache allocation; the points of one path are
interleaved per round so their ratios share the machine's state. With a batch, ms per token is per row (one step
of the batch); tok/s counts every row. Points whose KV cache would pass --max-cache-gib are
skipped. Prompts are HumanEval chat prompts (padded in front with more HumanEval text to the
length needed) for a target with a tokenizer, random ids otherwise. Writes capacity_scaling.json
and capacity_scaling.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm


def use_attention(impl: str) -> None:
    """Make every later trace use cache attention `impl` (see the module docstring) and drop the
    programs compiled with the previous one."""
    from spec_jax.models import attention

    backend = jax.default_backend()
    table = attention.LIVE_ATTENTION
    measured = use_attention.measured = getattr(use_attention, "measured", dict(table))
    default = measured.get(backend, attention.ACCELERATOR_LIVE_ATTENTION)
    if impl == "live":
        table[backend] = default
    else:
        name, _, block = impl.partition(":")
        table[backend] = (name, int(block) if block else default[1])
    jax.clear_caches()
    sys.modules["spec_jax.decoding.generate"]._COMPILED.clear()  # generate's compiled programs


def make_prompts(target: Any, batch: int, length: int, seed: int) -> list[list[int]]:
    """`batch` prompts of exactly `length` tokens: HumanEval chat prompts (the front padded with,
    or cut from, other HumanEval text) when the target has a tokenizer, else random ids."""
    if target.tokenizer is None:
        rng = np.random.default_rng(seed)
        return rng.integers(0, target.cfg.vocab_size, (batch, length)).tolist()
    from spec_jax.app.inputs import Prompt, encode_prompts
    from spec_jax.humaneval import humaneval_problems

    problems = humaneval_problems()
    filler = [t for p in problems[batch:] for t in target.tokenizer.encode(p["prompt"])]
    prompts = []
    for i in range(batch):
        chat = encode_prompts(target, [Prompt(text=problems[(seed + i) % len(problems)]["prompt"])])[0]
        prompts.append((filler[: max(0, length - len(chat))] + chat)[-length:])
    return prompts


def resolve_drafters(target: Any, names: list[str], batch: int) -> list[tuple[str, Any, Any, str]]:
    """(label, drafter, params, note) per name: "none" (AR), "default" (`spec_jax.default_drafter`
    for this batch; n-gram when loading it fails), or a kind of `spec_jax.load_drafter`."""
    from spec_jax.checkpoints.shipped import default_drafter_choice, is_default_target, load_drafter

    out = []
    for name in names:
        if name == "none":
            out.append(("ar", None, None, "plain decoding"))
            continue
        kind, k, note = name, None, name
        if name == "default":
            kind, k, note = default_drafter_choice(is_default_target(target), batch_size=batch)
        if kind == "none":
            continue  # the default for this target and batch is plain decoding: already measured
        try:
            drafter, params = load_drafter(kind, target, None, k)
        except Exception as error:  # noqa: BLE001 (a shipped asset mid-rewrite must not stop the run)
            kind, (drafter, params) = "ngram", load_drafter("ngram", target, None, k)
            note = f"n-gram: loading {name!r} failed ({type(error).__name__}: {error})"
        out.append((f"{kind} K={drafter.k}", drafter, params, note))
    return out


def generate_once(target, prompts, drafter, params, **kwargs):
    from spec_jax.decoding import generate

    return generate(target, prompts, drafter, params, ignore_eos=True, **kwargs)


def sweep(target, points: list[dict[str, Any]], drafters, new_tokens: int, repeats: int, bar) -> None:
    """Fill each point (capacity, prompts, drafter label) with its decode ms per token: the best
    of `repeats` runs of 1 and of `new_tokens` new tokens (one compiled program: max_new_tokens is
    traced), every point visited once per round."""
    by_label = {label: (d, p) for label, d, p, _ in drafters}

    def run(point, n):
        drafter, params = by_label[point["drafter"]]
        out = generate_once(target, point["prompts"], drafter, params, max_new_tokens=n,
                            capacity=point["capacity"])
        return out.generate_s, out.stats.tau

    for point in points:  # compile (and warm) each program first
        run(point, 1)
        bar.update(1)
    for _ in range(repeats):
        for point in points:
            point.setdefault("short_s", []).append(run(point, 1)[0])
            seconds, point["tau"] = run(point, new_tokens)
            point.setdefault("long_s", []).append(seconds)
            bar.update(1)
    for point in points:
        finish(point, new_tokens)


def finish(point: dict[str, Any], new_tokens: int) -> None:
    """ms per token (and tok/s) from the point's best times; None where the decode time is lost
    in the prefill's noise (long prompts, few steps)."""
    seconds = min(point["long_s"]) - min(point["short_s"])
    ok = seconds > 0.02 * min(point["short_s"])
    point["ms_per_token"] = seconds / (new_tokens - 1) * 1e3 if ok else None
    point["tok_s"] = point["batch"] * (new_tokens - 1) / seconds if ok else None


def main(argv: list[str] | None = None) -> int:
    from spec_jax.checkpoints import load_target
    from spec_jax.decoding.generate import default_capacity, prompt_bucket

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1", help="comma list of batch sizes")
    parser.add_argument("--impls", default="live,dense", help="comma list: live, dense, blocks[:N], buckets[:N]")
    parser.add_argument("--drafters", default="none,default", help="comma list: none, default, or a drafter kind")
    parser.add_argument("--capacities", default="512,2048,8192,32768")
    parser.add_argument("--live", type=int, default=100, help="mean live tokens of the capacity sweep")
    parser.add_argument("--lives", default="128,512,2048", help="prompt lengths of the live sweep (none to skip)")
    parser.add_argument("--live-capacity", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long", type=int, default=2048, help="new tokens of the long generation (0 to skip)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-cache-gib", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    target = load_target(args.target, dtype=args.dtype)
    batches = [int(b) for b in args.batch.split(",")]
    impls = args.impls.split(",")
    capacities = [int(c) for c in args.capacities.split(",")]
    lives = [int(x) for x in args.lives.split(",") if x not in ("", "none")]
    kv_gib = target.cfg.kv_bytes_per_token / 2**30
    fits = lambda batch, capacity: batch * capacity * kv_gib <= args.max_cache_gib  # noqa: E731
    drafters = {b: resolve_drafters(target, args.drafters.split(","), b) for b in batches}
    report: dict[str, Any] = {
        "kind": "capacity_scaling", "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(), "target": args.target or "default", "dtype": args.dtype,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "live": args.live,
        "live_capacity": args.live_capacity,
        "drafters": {b: {label: note for label, _, _, note in ds} for b, ds in drafters.items()},
        "capacity_sweep": [], "live_sweep": [], "long": [], "skipped": [],
    }
    sweep_prompt = args.live - args.new_tokens // 2
    plan = []  # (impl, batch, list of points)
    for impl in impls:
        for batch in batches:
            points = []
            for label, *_ in drafters[batch]:
                for capacity in capacities:
                    point = {"sweep": "capacity", "impl": impl, "batch": batch, "drafter": label,
                             "capacity": capacity, "prompt_tokens": sweep_prompt}
                    points.append(point)
                for prompt_len in lives:
                    point = {"sweep": "live", "impl": impl, "batch": batch, "drafter": label,
                             "capacity": args.live_capacity, "prompt_tokens": prompt_len}
                    points.append(point)
            ks = {label: drafter.k if drafter else 0 for label, drafter, *_ in drafters[batch]}
            kept = []
            for point in points:
                need = point["prompt_tokens"] + args.new_tokens + ks[point["drafter"]] + 1
                fit = fits(batch, point["capacity"]) and need <= point["capacity"]
                (kept if fit else report["skipped"]).append(point)
            plan.append((impl, batch, kept))
    total = sum(len(points) for *_, points in plan) * (1 + args.repeats)  # compile, then rounds
    total += len(impls) * sum(len(drafters[b]) for b in batches) * bool(args.long)
    bar = tqdm(total=total, desc="capacity scaling", disable=args.no_progress)
    for impl, batch, points in plan:
        use_attention(impl)
        for point in points:
            point["prompts"] = make_prompts(target, batch, point["prompt_tokens"], seed=0)
            point["live_mean"] = point["prompt_tokens"] + args.new_tokens / 2
        sweep(target, points, drafters[batch], args.new_tokens, args.repeats, bar)
        for point in points:
            del point["prompts"]
            report[f"{point.pop('sweep')}_sweep"].append(point)
            ms = "prefill noise" if point["ms_per_token"] is None else f"{point['ms_per_token']:.2f} ms/token"
            tqdm.write(f"{impl:>10} b{batch} {point['drafter']:>18} capacity {point['capacity']:>6} "
                       f"live ~{point['live_mean']:>6.0f}: {ms} (tau {point['tau']:.2f})")
        if args.long:
            prompts = make_prompts(target, batch, sweep_prompt, seed=0)
            for label, drafter, params, _ in drafters[batch]:
                k = drafter.k if drafter is not None else 0
                capacity = default_capacity(prompt_bucket(sweep_prompt), args.long, k)
                if not fits(batch, capacity):
                    report["skipped"].append({"long": args.long, "impl": impl, "batch": batch, "drafter": label})
                    continue
                t0 = time.perf_counter()
                out = generate_once(target, prompts, drafter, params, max_new_tokens=args.long)
                wall = time.perf_counter() - t0
                report["long"].append({
                    "impl": impl, "batch": batch, "drafter": label, "new_tokens": args.long,
                    "capacity": capacity, "generate_s": out.generate_s, "compile_s": out.compile_s,
                    "wall_s": wall, "tok_s": batch * args.long / out.generate_s, "tau": out.stats.tau,
                })
                tqdm.write(f"{impl:>10} b{batch} {label:>18} {args.long} new tokens (capacity {capacity}): "
                           f"{out.generate_s:.1f} s generate + {out.compile_s:.1f} s compile")
                bar.update(1)
    bar.close()
    use_attention("live")
    print(summary(report))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "capacity_scaling.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(report, args.out / "capacity_scaling.png")
    return 0


def summary(report: dict[str, Any]) -> str:
    """The capacity ratios (each capacity against the smallest) per path, drafter and batch."""
    lines = [f"{report['target']} {report['dtype']} on {report['device']} ({report['backend']})"]
    groups: dict[tuple, list[dict]] = {}
    for p in report["capacity_sweep"]:
        if p["ms_per_token"] is not None:
            groups.setdefault((p["impl"], p["batch"], p["drafter"]), []).append(p)
    for (impl, batch, drafter), points in groups.items():
        points.sort(key=lambda p: p["capacity"])
        base = points[0]["ms_per_token"]
        cells = ", ".join(f"{p['capacity']}: {p['ms_per_token']:.1f} ms ({p['ms_per_token'] / base:.2f}x)"
                          for p in points)
        lines.append(f"  {impl} b{batch} {drafter}: {cells}")
    for p in report["long"]:
        lines.append(f"  long {p['impl']} b{p['batch']} {p['drafter']}: {p['new_tokens']} tokens in "
                     f"{p['generate_s']:.1f} s ({p['tok_s']:.1f} tok/s, tau {p['tau']:.2f})")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, x, title in (
        (axes[0], "capacity_sweep", "capacity", f"~{report['live']} live tokens"),
        (axes[1], "live_sweep", "live_mean", f"capacity {report['live_capacity']}"),
    ):
        lines: dict[str, list[dict]] = {}
        for p in report[key]:
            if p["ms_per_token"] is not None:
                lines.setdefault(f"{p['impl']} b{p['batch']} {p['drafter']}", []).append(p)
        for name, points in sorted(lines.items()):
            points.sort(key=lambda p: p[x])
            ax.plot([p[x] for p in points], [p["ms_per_token"] for p in points], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache capacity (slots)" if x == "capacity" else "mean live tokens")
        ax.set_ylabel("ms per token")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"{report['target']} {report['dtype']} on {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

"""What `spec-jax serve`'s default costs against plain decoding inside the engine, without HTTP.

One process, one engine per configuration (8 slots, the serve defaults), the same chat requests
(--prompts humaneval: HumanEval's first 8 instead; 64 tokens each, greedy, EOS ignored)
submitted to each in turn, the order reversed every other round; prints per configuration the
median tokens/s and the median of the per-round ratios to plain decoding. Configurations:

    plain      no drafter
    default    serve's default for 8 slots (the measured drafter, each step picking its depth)
    dm-ngram   the draft model with prompt lookup at K = 2, adaptive (serve's default until
               session 31)
    forced     dm-ngram with drafting priced out (costs 1e6 plain steps), so every step is a
               plain one (a shadow probe's wait grows with that price: only the free ones, from
               the lookup alone, run): the adaptive program's plain step
    forced-model-only   the same, the model drafter alone (no prompt lookup in front)
    ngram      n-gram at K = 2, adaptive (serve's default for 8 slots on CPU since session 31;
               no drafter state: the policy's own bookkeeping)
    ngram4     n-gram at K = 4 (its own), adaptive
    NAME#TAG   a second engine of configuration NAME (plain#2: a control, whose ratio is the noise)
    NAME@FIELD=VALUE,...   an adaptive configuration with `AdaptiveDepth` fields overridden, e.g.
               dm-ngram@probe_backoff=3 or dm-ngram@shadow_every=64,margin=0.2 (a tuple's values
               colon-separated: ngram@depths=0:1:2,costs=1:1e6:1e6)

    python benchmarks/engine_plain_step.py --clients 1 8 --rounds 10
    python benchmarks/engine_plain_step.py --clients 1 --configs plain forced forced-model-only --rounds 14
    python benchmarks/engine_plain_step.py --clients 8 --configs plain default ngram --prompts humaneval

The HTTP load test (`load_test.py --rounds`) measures the same engines behind the server, where
client and server threads share the two cores with XLA; this one isolates the engine's steps.

`--by-chunk` prices each part of the default's cost without the machine's drift: every engine
gets 8 requests of --max-new-tokens at once and the engines' chunks alternate one by one; each
chunk run with all 8 slots busy is timed and filed by what happened in it (plain steps only, a
shadow probe, a drafting step); prints each kind's count and median, and the median plain chunk
against plain decoding's:

    python benchmarks/engine_plain_step.py --by-chunk --configs plain dm-ngram forced --rounds 4 --max-new-tokens 160

`--by-round` runs the 8-client rounds (the engines alternating round by round, as the default
mode does) and splits each engine's time into its parts: the admission step (8 prefills and the
first chunk), then every later chunk by kind; prints each part's time against plain decoding's:

    python benchmarks/engine_plain_step.py --by-round --configs plain plain#2 dm-ngram --rounds 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CONFIGS = ("plain", "default", "dm-ngram", "forced", "forced-model-only", "ngram", "ngram4")


def build(name: str, target):
    """(drafter, params, k) of a configuration."""
    from spec_jax.app.inputs import build_drafter, default_drafter_spec, parse_drafter_spec
    from spec_jax.decoding.depth import AdaptiveDepth
    from spec_jax.drafters.ngram import NGramDrafter

    if "#" in name:  # another engine of the same configuration
        return build(name.split("#")[0], target)
    if "@" in name:  # an adaptive configuration with the policy's fields overridden
        base, overrides = name.split("@", 1)
        drafter, params, _ = build(base, target)
        fields = {key: tuple(float(v) for v in value.split(":")) if key in ("costs", "depths")
                  else type(getattr(AdaptiveDepth, key))(value)
                  for key, value in (item.split("=", 1) for item in overrides.split(","))}
        if "depths" in fields:
            fields["depths"] = tuple(int(d) for d in fields["depths"])
        return drafter, params, AdaptiveDepth(**fields)
    if name == "plain":
        return None, None, None
    if name in ("ngram", "ngram4"):
        return NGramDrafter(k=4 if name == "ngram4" else 2), None, "adaptive"
    if name == "default":
        spec = default_drafter_spec(None, None, batch=8, engine=True)
        return (*build_drafter(spec, target), spec.generate_k)
    drafter, params = build_drafter(parse_drafter_spec("draft-model+ngram", 2), target)
    if name == "dm-ngram":
        return drafter, params, "adaptive"
    priced_out = AdaptiveDepth(depths=(0, 1, drafter.k), costs=(1.0, 1e6, 1e6))
    if name == "forced":
        return drafter, params, priced_out
    return drafter.model, params, priced_out  # forced-model-only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="requests in flight at once")
    p.add_argument("--configs", nargs="+", default=["plain", "default"],
                   help=f"from {', '.join(CONFIGS)}, or NAME@FIELD=VALUE,... (see above)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="a directory for results.json")
    p.add_argument("--prompts", choices=("chat", "humaneval"), default="chat",
                   help="the first 8 general chat prompts, or the first 8 HumanEval problems")
    p.add_argument("--by-chunk", action="store_true", help="time chunks one by one, the engines alternating")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (> 0: each request seeded by its round and client, so every "
                        "engine gets the same ones)")
    p.add_argument("--by-round", action="store_true",
                   help="8-client rounds, each engine's time split into admissions and chunks by kind")
    args = p.parse_args()
    bad = [c for c in args.configs if c.split("#")[0].split("@")[0] not in CONFIGS]
    if bad:
        p.error(f"unknown configurations {bad}; choose from {CONFIGS} (NAME@FIELD=VALUE,... to override)")
    if args.configs[0] != "plain":
        p.error("the first configuration is the baseline: plain")

    from spec_jax.app import compilation_cache

    compilation_cache.configure(None)
    from spec_jax import load_target
    from spec_jax.app.bench import chat_prompts
    from spec_jax.checkpoints import apply_chat_template
    from spec_jax.decoding.engine import Engine

    target = load_target(None, dtype="float32")
    if args.prompts == "chat":
        texts = [q.text for q in chat_prompts(8)]
    else:
        from spec_jax.humaneval import humaneval_problems

        texts = ["Complete this Python function:\n" + prob["prompt"] for prob in humaneval_problems()[:8]]
    prompts = [apply_chat_template(target.tokenizer, text, target.chat_template) for text in texts]
    engines = {}
    for name in args.configs:
        drafter, params, k = build(name, target)
        engine = Engine(target, drafter, params, slots=8, max_model_len=512, chunk_steps=4, k=k)
        engine.warmup()
        engines[name] = engine
        print(f"{name}: ready", flush=True)

    report = {}
    if args.by_chunk:
        report["by_chunk"] = by_chunk(engines, prompts, args.rounds, args.max_new_tokens, args.temperature)
    if args.by_round:
        report["by_round"] = by_round(engines, prompts, args.rounds, args.max_new_tokens, args.temperature)
    for clients in [] if args.by_chunk or args.by_round else args.clients:
        speeds = {name: [] for name in engines}
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                engine = engines[name]
                submit_round(engine, prompts, r, clients, args.max_new_tokens, args.temperature)
                start = time.perf_counter()
                engine.run_all()
                speeds[name].append(args.max_new_tokens * clients / (time.perf_counter() - start))
        rows = {}
        for name, engine in engines.items():
            ratios = [a / b for a, b in zip(speeds[name], speeds["plain"])]
            rows[name] = dict(tokens_per_s=statistics.median(speeds[name]), ratio=statistics.median(ratios),
                              ratios=ratios, depth_steps=dict(engine.depth_counts) or None,  # since start
                              shadow_probes=engine.shadow_probes if engine.depth is not None else None)
            print(f"clients {clients:2d} {name:18} {rows[name]['tokens_per_s']:7.1f} tok/s  "
                  f"x{rows[name]['ratio']:.3f} plain (rounds {min(ratios):.2f}-{max(ratios):.2f})  "
                  f"steps per depth {rows[name]['depth_steps']}", flush=True)
        report[clients] = rows
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "clients": report}, indent=1) + "\n")


def by_chunk(engines: dict, prompts: list, rounds: int, max_new_tokens: int, temperature: float) -> dict:
    """Each engine's chunk times by kind (plain / probe / draft / probe+draft), the engines' chunks
    alternating one by one (the order reversed every other round), chunks with all 8 slots busy."""
    times: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for r in range(rounds):
        for engine in engines.values():
            submit_round(engine, prompts, r, 8, max_new_tokens, temperature)
            engine.step()  # the admissions and a first chunk, not timed
        order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
        while any(engine.has_work() for engine in engines.values()):
            for name, engine in order:
                if not engine.has_work():
                    continue
                busy = len(engine.slot_table.running) == 8
                kind, elapsed = timed_step(engine)
                if busy:
                    times[name].setdefault(kind, []).append(elapsed)
    plain = statistics.median(times["plain"]["plain"])
    report = {}
    for name, kinds in times.items():
        report[name] = {kind: dict(chunks=len(v), median_ms=1e3 * statistics.median(v)) for kind, v in kinds.items()}
        report[name]["plain_chunk_vs_plain_decoding"] = statistics.median(kinds["plain"]) / plain
        print(f"{name:18} plain chunk x{report[name]['plain_chunk_vs_plain_decoding']:.4f} plain decoding's; " +
              ", ".join(f"{kind}: {len(v)} chunks, median {1e3 * statistics.median(v):.1f} ms"
                        for kind, v in kinds.items()), flush=True)
    return report


def submit_round(engine, prompts: list, r: int, clients: int, max_new_tokens: int, temperature: float) -> None:
    """Round r's requests, one per client (sampled ones seeded by round and client, so every
    engine gets the same ones)."""
    for i in range(clients):
        sampled = {} if temperature <= 0 else dict(temperature=temperature, seed=1000 * r + i)
        engine.submit(prompts[(r + i) % len(prompts)], max_new_tokens=max_new_tokens, ignore_eos=True, **sampled)


def timed_step(engine) -> tuple[str, float]:
    """(what happened in it: "plain", "probe", "draft" or "probe+draft"; seconds) of one `step()`."""
    drafted = sum(n for d, n in engine.depth_counts.items() if d)
    probes = engine.shadow_probes
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    kind = "+".join(k for k, happened in (
        ("probe", engine.shadow_probes > probes),
        ("draft", sum(n for d, n in engine.depth_counts.items() if d) > drafted)) if happened)
    return kind or "plain", elapsed


def by_round(engines: dict, prompts: list, rounds: int, max_new_tokens: int, temperature: float) -> dict:
    """Each engine's time in 8-client rounds (the engines alternating round by round, the order
    reversed every other round), split into the admission step (the prefills and the first chunk)
    and the later chunks by kind; each part's time over plain decoding's total."""
    parts: dict[str, dict[str, list[float]]] = {name: {"admission step": []} for name in engines}
    totals: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        for name, engine in (list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))):
            submit_round(engine, prompts, r, 8, max_new_tokens, temperature)
            start, first = time.perf_counter(), True
            while engine.has_work():
                kind, elapsed = timed_step(engine)
                parts[name].setdefault("admission step" if first else kind, []).append(elapsed)
                first = False
            totals[name].append(time.perf_counter() - start)
    plain_total = sum(totals["plain"])
    plain_chunk = statistics.mean(parts["plain"]["plain"])
    report = {}
    for name, kinds in parts.items():
        ratios = [a / b for a, b in zip(totals["plain"], totals[name])]
        row = dict(ratio=plain_total / sum(totals[name]), round_ratios=ratios, parts={})
        for kind, v in kinds.items():
            # extra: this part's time beyond what plain decoding's plain chunks (or admission
            # steps) took for as many, over plain decoding's total
            base = statistics.mean(parts["plain"]["admission step"]) if kind == "admission step" else plain_chunk
            row["parts"][kind] = dict(count=len(v), mean_ms=1e3 * statistics.mean(v),
                                      extra=(sum(v) - base * len(v)) / plain_total)
        report[name] = row
        print(f"{name:24} x{row['ratio']:.3f} plain (rounds {min(ratios):.2f}-{max(ratios):.2f}); " + ", ".join(
            f"{kind}: {part['count']} x {part['mean_ms']:.1f} ms ({100 * part['extra']:+.1f}%)"
            for kind, part in row["parts"].items()), flush=True)
    return report


if __name__ == "__main__":
    main()

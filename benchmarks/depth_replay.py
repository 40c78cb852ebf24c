"""Replay the adaptive depth policy on recorded greedy walks: its choices, step by step, without
the machine's timing noise.

    python benchmarks/depth_replay.py --chat 20 --humaneval 20 --costs 1,2,2,2 [--record DIR]

Greedy speculative decoding emits exactly the plain decoding's tokens, so a run of the default
model with the default drafter for batch 1 (prompt lookup in front of DFlash, K = 7, a chain)
follows from three things recorded once per prompt: the plain output, the drafts DFlash would
propose with every position as the anchor, and the lookup's drafts and match length at every
position (as `lookup_replay.py` does). This script records them (`--record DIR` keeps them in
an .npz per prompt set, read back on the next run), then replays `spec_jax.decoding.depth`'s
own `choose`, `shadow_due`, `record_shadow` and `record` (the policy the loop runs, jitted, one
row) step by step, and prices each step with the given costs per depth (a plain step's cost
first; `--costs 1,2,2,2` is this CPU's measured shape, a K = 7 verify about twice a plain step;
`--shadow-cost` the price of DFlash's draft pass, as a fraction of a plain step: a shadow probe
pays it, and a step whose drafts are the lookup's saves it). It reports, per prompt set, the
modelled speed against plain decoding of fixed K = 7, of the adaptive policy (`--policy` sets
its fields; `--one-source` one acceptance rate for both kinds of drafts, as before draft
sources), and of a reference rule (draft exactly where the lookup matches), and the steps per
depth.

What it leaves out, on purpose: the loop's own per-step overhead (measured end to end by
`adaptive_depth.py`), and sampling (greedy walks only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def record_walks(kind: str, count: int, max_new_tokens: int, k: int, cache: Path | None) -> list[dict]:
    """Per prompt: prompt length, the whole sequence (prompt + plain output), DFlash's drafts
    [n, k] and the combined (lookup-first) drafts [n, k] at every anchor, the lookup's match."""
    path = None if cache is None else cache / f"{kind}_{count}_{max_new_tokens}_k{k}.npz"
    if path is not None and path.exists():
        data = np.load(path, allow_pickle=True)
        return list(data["walks"])
    from lookup_replay import lookups, model_drafts
    from tqdm import tqdm

    from spec_jax import default_drafter, generate, load_target
    from spec_jax.app.bench import chat_prompts
    from spec_jax.checkpoints import apply_chat_template
    from spec_jax.humaneval import humaneval_problems

    target = load_target(None, dtype="float32")
    drafter, params, _ = default_drafter(target, batch_size=1)

    def chat(text):
        return apply_chat_template(target.tokenizer, [{"role": "user", "content": text}], target.chat_template)

    if kind == "chat":
        prompts = [chat(p.text) for p in chat_prompts(count)]
    else:
        prompts = [chat("Complete this Python function:\n" + p["prompt"]) for p in humaneval_problems()[:count]]
    walks = []
    for prompt in tqdm(prompts, desc=f"recording {kind} walks"):
        out = generate(target, [prompt], max_new_tokens=max_new_tokens, ignore_eos=True).generated_ids[0]
        seq = list(prompt) + list(out)
        dflash = model_drafts(target, drafter.model, params, seq, k)
        looked, matched = lookups(seq, k, drafter.max_ngram)
        combined = np.where((matched >= drafter.min_match)[:, None], looked, dflash)
        walks.append({"prompt_len": len(prompt), "seq": np.asarray(seq), "dflash": dflash,
                      "combined": combined, "matched": matched})
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, walks=np.asarray(walks, dtype=object))
    return walks


def accepted_run(walk: dict, anchor: int, depth: int) -> int:
    """Drafts accepted at `anchor` (the last committed position) drafting `depth` tokens."""
    seq, drafts = walk["seq"], walk["combined"][anchor]
    run = 0
    while run < depth and anchor + 1 + run < len(seq) and drafts[run] == seq[anchor + 1 + run]:
        run += 1
    return run


def replay_fixed(walk: dict, k: int, costs: dict[int, float], shadow_cost: float, min_match: int = 2
                 ) -> tuple[float, int]:
    """(modelled time, tokens) of fixed K (a step with the lookup's drafts skips DFlash's pass)."""
    anchor, end, time = walk["prompt_len"], len(walk["seq"]) - 1, 0.0
    tokens = 0
    while anchor < end:
        n = accepted_run(walk, anchor, k)
        step = min(n + 1, end - anchor)
        cost = costs[k] - (shadow_cost * costs[0] if walk["matched"][anchor] >= min_match else 0.0)
        anchor, tokens, time = anchor + step, tokens + step, time + cost
    return time, tokens


def replay_lookup_rule(walk: dict, k: int, costs: dict[int, float], shadow_cost: float, min_match: int = 2
                       ) -> tuple[float, int]:
    """(modelled time, tokens) of a reference rule, not a policy: draft at K exactly where the
    lookup matches (its drafts only, so no model pass), step plainly elsewhere."""
    anchor, end, time, tokens = walk["prompt_len"], len(walk["seq"]) - 1, 0.0, 0
    while anchor < end:
        if walk["matched"][anchor] >= min_match:
            step, time = min(accepted_run(walk, anchor, k) + 1, end - anchor), time + costs[k] - shadow_cost * costs[0]
        else:
            step, time = 1, time + costs[0]
        anchor, tokens = anchor + step, tokens + step
    return time, tokens


def replay_adaptive(walk: dict, policy, costs: dict[int, float], shadow_cost: float,
                    min_match: int = 2, sourced: bool = True, believed: dict | None = None) -> tuple[float, int, dict]:
    """(modelled time, tokens, steps per depth and shadow probes) of the adaptive policy, run by
    depth.py's own `choose`, `shadow_due`, `record_shadow` and `record`. A shadow probe costs a
    draft pass (`shadow_cost` plain steps), nothing where the lookup matched (DFlash is skipped)."""
    anchor, end, time, tokens = walk["prompt_len"], len(walk["seq"]) - 1, 0.0, 0
    state = policy.initial_state(1, end + 2, [(believed or costs)[d] for d in policy.depths],
                                 sources=2 if sourced else 1)
    choose, due_fn, record = _jitted(policy)
    steps: dict = {}
    live = jnp.ones((1,), bool)
    step, shadowing = 0, policy.shadow_every > 0
    while anchor < end:
        looked_up = bool(walk["matched"][anchor] >= min_match)
        source = jnp.asarray([int(looked_up)], jnp.int32) if sourced else None
        index = int(choose(state, live, not shadowing, source))
        d = policy.depths[index]
        n = accepted_run(walk, anchor, d) if d else 0
        emitted = min(n + 1, end - anchor)
        due = bool(d == 0 and shadowing and due_fn(state, live, looked_up and sourced))
        if due:
            time += (0.0 if looked_up else shadow_cost) * costs[0]
            steps["shadow"] = steps.get("shadow", 0) + 1
        drafts = jnp.asarray(walk["combined"][anchor][None, : policy.max_depth], jnp.int32)
        committed = jnp.asarray([walk["seq"][anchor + 1]], jnp.int32)
        state = record(state, jnp.int32(index), jnp.int32(step), live, jnp.asarray([n], jnp.int32),
                       jnp.asarray(due), drafts, committed, source, d == 0 and shadowing)
        steps[d] = steps.get(d, 0) + 1
        # A step whose drafts are the lookup's skips DFlash's pass (`LookupFirstDrafter`).
        cost = costs[d] - (shadow_cost * costs[0] if d and looked_up else 0.0)
        anchor, tokens, time, step = anchor + emitted, tokens + emitted, time + cost, step + 1
    return time, tokens, steps


_JITTED: dict = {}


def _jitted(policy):
    from spec_jax.decoding import depth as depth_lib

    if policy not in _JITTED:
        def record(state, index, step, live, accepted, due, drafts, committed, source, shadowing):
            if shadowing:
                state = depth_lib.record_shadow(policy, state, live, committed, due, drafts, source)
            return depth_lib.record(policy, state, index, step, live, accepted, source)

        _JITTED[policy] = (jax.jit(lambda s, live, verify, source: depth_lib.choose(policy, s, live, verify, source)),
                           jax.jit(lambda s, live, free: depth_lib.shadow_due(policy, s, live, free)),
                           jax.jit(record, static_argnums=9))
    return _JITTED[policy]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chat", type=int, default=20)
    p.add_argument("--humaneval", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--costs", default="1,2,2,2", help="cost of a step at depths 0, 2, K/2, K (plain first)")
    p.add_argument("--shadow-cost", type=float, default=0.35, help="a draft pass alone / a plain step")
    p.add_argument("--record", type=Path, default=None, help="keep the recorded walks here")
    p.add_argument("--policy", default="{}", help="AdaptiveDepth fields as JSON, e.g. '{\"margin\": 0.1}'")
    p.add_argument("--believed-costs", default=None, help="the costs the policy is given (default --costs)")
    p.add_argument("--one-source", action="store_true",
                   help="one acceptance rate for the lookup's and DFlash's drafts together")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from spec_jax.decoding.depth import AdaptiveDepth

    policy = AdaptiveDepth(**json.loads(args.policy)).for_k(args.k)
    cost_list = [float(c) for c in args.costs.split(",")]
    costs = dict(zip(policy.depths, cost_list))
    believed = dict(zip(policy.depths, [float(c) for c in args.believed_costs.split(",")])) if args.believed_costs else None
    rows = {}
    for kind, count in (("chat", args.chat), ("humaneval", args.humaneval)):
        if not count:
            continue
        walks = record_walks(kind, count, args.max_new_tokens, args.k, args.record)
        ratios_fixed, ratios_adaptive, ratios_rule, all_steps = [], [], [], {}
        for walk in walks:
            t_fixed, n = replay_fixed(walk, args.k, costs, args.shadow_cost)
            t_adapt, n2, steps = replay_adaptive(walk, policy, costs, args.shadow_cost, sourced=not args.one_source,
                                                 believed=believed)
            assert n == n2
            plain = n * costs[0]
            ratios_fixed.append(plain / t_fixed)
            ratios_adaptive.append(plain / t_adapt)
            ratios_rule.append(plain / replay_lookup_rule(walk, args.k, costs, args.shadow_cost)[0])
            for d, c in steps.items():  # depths and "shadow"
                all_steps[d] = all_steps.get(d, 0) + c
        rows[kind] = {
            "prompts": len(walks),
            "fixed": {"median": float(np.median(ratios_fixed)), "mean": float(np.mean(ratios_fixed))},
            "adaptive": {"median": float(np.median(ratios_adaptive)), "mean": float(np.mean(ratios_adaptive)),
                         "min": float(np.min(ratios_adaptive))},
            "lookup_rule": {"median": float(np.median(ratios_rule)), "mean": float(np.mean(ratios_rule))},
            "steps_per_depth": {str(d): all_steps[d] for d in sorted(all_steps, key=str)},
            "per_prompt": [[round(f, 3), round(a, 3)] for f, a in zip(ratios_fixed, ratios_adaptive)],
        }
        r = rows[kind]
        print(f"{kind:10s} fixed K={args.k}: median {r['fixed']['median']:.3f}x  adaptive: median "
              f"{r['adaptive']['median']:.3f}x mean {r['adaptive']['mean']:.3f}x min {r['adaptive']['min']:.3f}x  "
              f"steps {r['steps_per_depth']}  (draft where the lookup matches: median "
              f"{r['lookup_rule']['median']:.3f}x mean {r['lookup_rule']['mean']:.3f}x)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "depth_replay.json").write_text(json.dumps(
            {"costs": cost_list, "shadow_cost": args.shadow_cost, "policy": args.policy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

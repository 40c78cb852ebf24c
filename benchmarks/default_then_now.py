"""The default drafter as it was when issue 41 was filed against the default now, on this machine.

Issue 41's HumanEval bar is relative ("keeps at least 90% of today's 1.9x", where the 1.9x was
taken on another VM), so this script runs the same workload on two checkouts: run it with
`PYTHONPATH=<a checkout of 764bdb0^>` (the code the issue was filed against: DFlash + lookup,
K = 7, a chain) and with this checkout (the measured default, each step picking its depth), in
alternating processes, and compare the speedups. It uses only the API both have: `load_target`,
`default_drafter`, `generate`, `humaneval_problems`, `apply_chat_template`.

Batch 1, greedy, 128 tokens, EOS ignored; for each prompt, plain decoding and the default drafter,
--repeats times in alternating order; prints each prompt's median speedup and the medians per
prompt kind, checks every output equal to plain decoding's, and appends a JSON line to --out.

    PYTHONPATH=/tmp/old python benchmarks/default_then_now.py --label then --out then_now.jsonl
    python benchmarks/default_then_now.py --label now --out then_now.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "spec_jax" / "assets" / "chat_prompts.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="a name for this checkout's run (then / now)")
    p.add_argument("--humaneval", type=int, default=8)
    p.add_argument("--chat", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="a JSON-lines file to append this run to")
    args = p.parse_args()

    import spec_jax
    from spec_jax import default_drafter, generate, load_target
    from spec_jax.checkpoints import apply_chat_template
    from spec_jax.humaneval import humaneval_problems

    try:  # the command line's compilation cache where the checkout has one (not timed either way)
        from spec_jax.app import compilation_cache

        compilation_cache.configure(None)
    except ImportError:
        pass
    target = load_target(None, dtype="float32")
    drafter, drafter_params, reason = default_drafter(target, batch_size=1)
    extra = {}
    try:  # the checkout's command-line default: adaptive depth where it has one
        from spec_jax.app.inputs import default_drafter_spec

        extra = dict(k=default_drafter_spec(None, None, batch=1).generate_k)
    except (ImportError, AttributeError):
        pass
    print(f"{args.label}: {spec_jax.__file__}\n  drafter {type(drafter).__name__} K={drafter.k} {extra}\n  {reason}", flush=True)

    def chat(text):
        return apply_chat_template(target.tokenizer, [{"role": "user", "content": text}], target.chat_template)

    chats = json.loads(CHAT_PROMPTS.read_text())["prompts"][: args.chat]
    prompts = [("humaneval", prob["task_id"], chat("Complete this Python function:\n" + prob["prompt"]))
               for prob in humaneval_problems()[: args.humaneval]]
    prompts += [("chat", c["id"], chat(c["text"])) for c in chats]
    methods = {"plain": dict(drafter=None, drafter_params=None),
               "default": dict(drafter=drafter, drafter_params=drafter_params, **extra)}
    common = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for kw in methods.values():  # compile (and any one-time cost measurement), not timed
        generate(target, [prompts[0][2]], **kw, **common)

    rows = []
    for kind, label, ids in prompts:
        speeds = {name: [] for name in methods}
        outputs = {}
        for rep in range(args.repeats):
            for name in (list(methods) if rep % 2 == 0 else list(reversed(methods))):
                r = generate(target, [ids], **methods[name], **common)
                speeds[name].append(r.tokens_per_second)
                outputs[name] = r.generated_ids
        speedup = statistics.median(speeds["default"]) / statistics.median(speeds["plain"])
        rows.append(dict(kind=kind, prompt=label, speedup=speedup, exact=outputs["default"] == outputs["plain"],
                         plain_tokens_per_s=statistics.median(speeds["plain"])))
        print(f"  {kind:10} {label:24} {speedup:5.2f}x  exact={rows[-1]['exact']}", flush=True)
    summary = {kind: statistics.median(r["speedup"] for r in rows if r["kind"] == kind) for kind in ("humaneval", "chat")}
    print(f"{args.label}: median speedup " + ", ".join(f"{k} {v:.2f}x" for k, v in summary.items()), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(dict(label=args.label, drafter=f"{type(drafter).__name__} K={drafter.k} {extra}",
                                    summary=summary, rows=rows)) + "\n")


if __name__ == "__main__":
    main()

"""Replay greedy speculative decoding to choose how prompt lookup and DFlash share the drafting.

    python benchmarks/lookup_replay.py [--num-prompts 40] [--max-new-tokens 128] [--k 7] [--out DIR]

Greedy speculative decoding emits exactly the AR tokens, so its whole walk (anchor, accepted run,
next anchor) follows from the AR output and what each drafter would propose at each anchor. This
script computes those once -- the shipped DFlash drafter's block at every position in one pass
(`spec_jax.training.dflash.block_hidden`), and the n-gram lookup at every position
(`NGramDrafter.lookup`) -- and replays the walk for each rule in seconds, where a bench run
takes minutes per setting. Its tau equals `spec-jax bench`'s on the same prompts and K
(HumanEval[:20], K=7: DFlash 2.340 vs 2.34, n-gram 2.276 vs 2.28, dflash+ngram 3.405 vs 3.40).

The settings of `LookupFirstDrafter` were chosen on HumanEval[20:40] ("dev": never trained on,
not the bench's prompts) and then read on HumanEval[:20] ("bench").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from spec_jax.drafters.dflash import dflash_logits
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.training.dflash import block_hidden
from spec_jax.training.features import jitted_target_features

DEV, BENCH = range(20, 40), range(0, 20)
_block_hidden = jax.jit(block_hidden, static_argnums=0)


def model_drafts(target, drafter, params, seq: list[int], k: int) -> np.ndarray:
    """[len(seq), k]: the DFlash drafter's argmax drafts with every position as the anchor."""
    cfg = drafter.cfg
    size = -(-len(seq) // 64) * 64  # a few padded lengths: a few compiles
    tokens = jnp.asarray(np.pad(seq, (0, size - len(seq)))[None], jnp.int32)
    captured, _ = jitted_target_features(target.cfg, tuple(cfg.target_layer_ids))(target.params, tokens)
    anchors = jnp.arange(size, dtype=jnp.int32)[None]
    hidden = _block_hidden(cfg, params, target.target, tokens, captured, anchors)
    hidden = hidden.reshape(size, cfg.block_size, -1)[:, 1 : 1 + k]
    logits = dflash_logits(cfg, params, target.target, hidden)
    return np.asarray(jnp.argmax(logits, -1))[: len(seq)]


def lookups(seq: list[int], k: int, max_ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """([len(seq), k] drafts, [len(seq)] matched n) of the n-gram lookup with committed length a + 1
    for every anchor a (one batched call: row a sees the same tokens, its own length)."""
    n = len(seq)
    tokens = jnp.broadcast_to(jnp.asarray(seq, jnp.int32), (n, n))
    drafts, matched = _lookup(NGramDrafter(k=k, max_ngram=max_ngram, min_ngram=1), tokens,
                              jnp.arange(1, n + 1, dtype=jnp.int32))
    return np.asarray(drafts), np.asarray(matched)


_lookup = jax.jit(lambda drafter, tokens, lengths: drafter.lookup(tokens, lengths), static_argnums=0)


def replay(seq: list[int], first: int, drafts_at, k: int) -> int:
    """Verify steps of greedy decoding from anchor `first` (the prefill's token) to the end of seq,
    with drafts_at(anchor) -> k drafts."""
    steps, a = 0, first
    while a < len(seq) - 1:
        drafts = drafts_at(a)
        run = 0
        while run < k and a + 1 + run < len(seq) and drafts[run] == seq[a + 1 + run]:
            run += 1
        steps, a = steps + 1, a + run + 1
    return steps


def main() -> None:
    from spec_jax.app.inputs import DrafterSpec, build_drafter
    from spec_jax.checkpoints import apply_chat_template, load_target
    from spec_jax.decoding import generate
    from spec_jax.humaneval import humaneval_problems

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="write replay.json here")
    args = parser.parse_args()

    target = load_target(None)
    drafter, params = build_drafter(DrafterSpec("dflash", k=args.k), target)
    problems = humaneval_problems()[: args.num_prompts]
    prompts = [apply_chat_template(target.tokenizer, p["prompt"], target.chat_template) for p in problems]
    ar = generate(target, prompts, max_new_tokens=args.max_new_tokens)
    rules = {"dflash": None, "ngram (min 1, max 3: the n-gram drafter)": None}
    for max_ngram in (3, 4, 6):
        for min_match in (1, 2, 3):
            rules[f"lookup-first min {min_match} max {max_ngram}"] = (min_match, max_ngram)
    totals = {name: {"dev": [0, 0], "bench": [0, 0]} for name in rules}
    for i, (prompt, out) in enumerate(tqdm(list(zip(prompts, ar.generated_ids)), desc="replay")):
        seq = list(prompt) + list(out)
        model = model_drafts(target, drafter, params, seq, args.k)
        looked = {n: lookups(seq, args.k, n) for n in (3, 4, 6)}
        part = "dev" if i in DEV else "bench" if i in BENCH else None
        for name, setting in rules.items():
            if name == "dflash":
                at = lambda a: model[a]
            elif setting is None:  # the plain n-gram drafter: min 1, max 3
                at = lambda a: looked[3][0][a]
            else:
                min_match, max_ngram = setting
                drafts, matched = looked[max_ngram]
                at = lambda a, d=drafts, m=matched, lo=min_match: d[a] if m[a] >= lo else model[a]
            steps = replay(seq, len(prompt), at, args.k)
            if part:
                totals[name][part][0] += steps
                totals[name][part][1] += len(seq) - len(prompt) - 1
    table = {name: {part: t[1] / max(t[0], 1) for part, t in parts.items()} for name, parts in totals.items()}
    print(f"greedy replay, K={args.k}, {args.max_new_tokens} new tokens; tau = tokens per verify step")
    print(f"{'rule':44s} {'dev (HumanEval[20:40])':>24s} {'bench (HumanEval[:20])':>24s}")
    for name, t in table.items():
        print(f"{name:44s} {t['dev']:24.3f} {t['bench']:24.3f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "replay.json").write_text(json.dumps(
            {"k": args.k, "max_new_tokens": args.max_new_tokens, "tau": table}, indent=1))


if __name__ == "__main__":
    main()

"""`spec-jax train mtp` on a tiny Gemma 4 target: loss curve, time per step, held-out tau of the
trained assistant against the untrained one, and (--check) that the training logits are the
inference chain's.

    python benchmarks/mtp_training.py                 # train, print JSON (RESULTS.md, issue 40)
    python benchmarks/mtp_training.py --check         # training logits vs propose's, both MTP drafters

The target is tests/tiny_configs.py's TINY_GEMMA4 (random weights, scale 3): its greedy answers
to random prompts are the data (self-distillation, as `spec-jax train data` makes them), a
quarter of the prompts held out for tau. --check builds, for anchors p of a random sequence, the
loop's state after a prefill of tokens[:p] with token p committed last, and compares the
drafter's own chain (`draft_logits`, fed the true tokens) with `training_logits` at p, for the
Gemma 4 assistant and the Qwen3.5 MTP head (a tiny Qwen3.5 target).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_configs import TINY_GEMMA4, TINY_TARGET  # noqa: E402

from spec_jax.checkpoints import LoadedModel  # noqa: E402
from spec_jax.models import Decoder, Target, init_params  # noqa: E402

QWEN3_5 = TINY_TARGET.replace(
    architecture="qwen3_5", layer_types=("linear_attention", "full_attention"), num_heads=8, num_kv_heads=4,
    head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    attn_output_gate=True, qk_norm=True, norm_offset=1.0, partial_rotary_factor=0.5,
)


def check(cfg, k: int = 3, anchors=(5, 9), length: int = 14) -> list[float]:
    """Max |training logits - inference chain logits| at each anchor."""
    from spec_jax.decoding.loop import forward_capturing
    from spec_jax.training.mtp import MtpRecipe

    params = init_params(cfg, jax.random.key(0), scale=2.0)
    target = LoadedModel(cfg, params, None, None, "tiny")
    recipe = MtpRecipe.for_target(target, hidden=32, layers=2, k=k, anchors=len(anchors))
    drafter = recipe.drafter
    dparams = jax.tree.map(jnp.asarray, recipe.initial_params(target, 0, None))
    tokens = jnp.asarray(np.random.RandomState(1).randint(3, cfg.vocab_size, (1, length)), jnp.int32)
    model = Decoder(cfg)
    tgt = Target(params, model)
    positions = jnp.arange(length)[None]
    _, captured, cache = forward_capturing(tgt, tokens, positions, model.init_cache(1, length), drafter.capture_layers)
    train = drafter.training_logits(dparams, tgt.replace(cache=cache), tokens, captured, jnp.array([anchors]))
    buffer = jnp.zeros((1, 32), jnp.int32).at[:, :length].set(tokens)
    out = []
    for a, p in enumerate(anchors):
        prefix_cache = model.init_cache(1, 32)
        _, prefix_captured, prefix_cache = forward_capturing(tgt, tokens[:, :p], positions[:, :p], prefix_cache,
                                                             drafter.capture_layers)
        view = tgt.replace(cache=model.commit(prefix_cache, jnp.array([p])))
        state = drafter.init(dparams, tgt, tokens[:, :p], jnp.array([p]), prefix_captured, 32)
        logits = drafter.draft_logits(dparams, view, state, buffer, jnp.array([p + 1]),
                                      lambda step, _, p=p: buffer[:, p + step + 1])[0]
        out.append(float(jnp.max(jnp.abs(logits[0] - train[0, a]))))
    return out


def train_run(args) -> dict:
    from spec_jax.decoding import generate
    from spec_jax.training.data import TokenDataset
    from spec_jax.training.mtp import MtpRecipe, train_mtp
    from spec_jax.training.run import held_out_tau
    from spec_jax.training.trainer import TrainConfig

    params = jax.jit(lambda key: init_params(TINY_GEMMA4, key, scale=3.0))(jax.random.key(0))
    target = LoadedModel(TINY_GEMMA4, params, None, None, "tiny")
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 128, rng.randint(4, 13))) for _ in range(args.prompts)]
    answers = generate(target, prompts, max_new_tokens=args.answer_tokens, ignore_eos=True).generated_ids
    data = TokenDataset.from_sequences([p + a for p, a in zip(prompts, answers)], [len(p) for p in prompts],
                                       ["bench"] * len(prompts))
    cfg = TrainConfig(steps=args.steps, batch_size=8, seq_len=args.answer_tokens + 16, learning_rate=3e-3,
                      warmup_steps=10, save_every=args.steps, log_every=10, eval_every=0)
    recipe = MtpRecipe.for_target(target, hidden=64, layers=2, k=args.k, anchors=8)
    out_dir = Path(tempfile.mkdtemp())
    eval_prompts = args.prompts // 4
    _, _, result = train_mtp(target, data, out_dir, cfg, hidden=64, layers=2, k=args.k, anchors=8,
                             eval_prompts=eval_prompts, eval_tokens=args.answer_tokens, progress=False)
    log = json.loads((out_dir / "training_log.json").read_text())
    # The untrained assistant on the same held-out prompts (the same compiled loop).
    from spec_jax.training.run import held_out_prompts

    _, held_out, _ = held_out_prompts(target, data, eval_prompts, cfg.seed, cfg.seq_len)
    untrained = held_out_tau(target, recipe.drafter, jax.tree.map(jnp.asarray, recipe.initial_params(target, 0, None)),
                             held_out, args.answer_tokens)
    # Time per step after compiling: the logged steps' wall time is not kept, so time a few more.
    from spec_jax.training.mtp import MtpLoss
    from spec_jax.training.trainer import TrainState, make_optimizer, make_train_step

    loss = MtpLoss(recipe.drafter, target.model, anchors=8)
    optimizer = make_optimizer(cfg)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=result.state.params,
                       opt_state=optimizer.init(result.state.params))
    step = make_train_step(loss, optimizer, 0)
    from spec_jax.training.data import iterate_batches

    b = next(iterate_batches(data, 8, cfg.seq_len, 0, 0))
    batch = {"tokens": b.tokens, "lengths": b.lengths, "prompt_lengths": b.prompt_lengths}
    t0 = time.perf_counter()
    state, _ = step(state, target.params, batch)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(10):
        state, _ = step(state, target.params, batch)
    jax.block_until_ready(state)
    return {
        "backend": jax.default_backend(), "steps": args.steps, "k": args.k, "batch": 8, "seq_len": cfg.seq_len,
        "anchors": 8, "train_sequences": len(data) - eval_prompts, "held_out_prompts": eval_prompts,
        "loss_curve": [(h["step"], round(h["loss"], 3), round(h.get("accept_run", float("nan")), 3)) for h in log["history"]],
        "train_seconds": round(result.seconds, 1), "step_ms": round((time.perf_counter() - t0) / 10 * 1000, 1),
        "step_compile_s": round(compile_s, 1),
        "held_out_tau_trained": round(result.evals[-1]["tau"], 3), "held_out_tau_untrained": round(untrained["tau"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.check:
        print(json.dumps({"gemma4_assistant": check(TINY_GEMMA4), "qwen3_5_mtp_head": check(QWEN3_5)}))
    else:
        print(json.dumps(train_run(args)))


if __name__ == "__main__":
    main()

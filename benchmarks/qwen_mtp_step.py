"""The loop's step with the Qwen3.5 MTP head (`--drafter mtp=TARGET_DIR`) against plain decoding,
on a random Qwen3.5 target: a chain of K drafts, and the head's share of the step.

    python benchmarks/qwen_mtp_step.py                                  # random:qwen3.5-9b-scaled, float32 (this CPU)
    python benchmarks/qwen_mtp_step.py --target random:qwen3.5-9b --dtype bfloat16 --context 1024   # a GPU

Random weights accept (almost) nothing, so each step commits about one token: the numbers are
what a step costs (one verify pass of K + 1 tokens plus the drafting); a real head with
acceptance length tau runs at about tau x (AR step / MTP step) of plain decoding. The head's
share is its `propose` alone (the pending pairs, then the chain), jitted after the prompt, best
of --repeats, over the step. Step times as in dflash_step.py: per loop step of the real
`generate` loop, prefill removed by difference, best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash_step import loop_step_seconds  # noqa: E402


def propose_seconds(target, drafter, params, prompt: list[int], capacity: int, repeats: int) -> float:
    """Seconds of one `propose` after `prompt` (its pending pair and the K-step chain)."""
    from spec_jax.models import Decoder, Target
    from spec_jax.sampling import SamplingParams

    model, n = Decoder(target.cfg), len(prompt)
    tokens = jnp.asarray([prompt], jnp.int32)
    view = Target(target.params, model)
    out = jax.jit(lambda p, t: model.forward(p, t, jnp.arange(n)[None], model.init_cache(1, capacity)))(
        target.params, tokens)
    state = jax.jit(lambda dp, tp, h: drafter.init(dp, Target(tp, model), tokens, jnp.asarray([n]), h, capacity))(
        params, target.params, out.hidden)
    first = jnp.argmax(view.logits(out.hidden[:, -1]), axis=-1)
    buffer = jnp.zeros((1, capacity), jnp.int32).at[:, :n].set(tokens).at[:, n].set(first)
    lengths = jnp.asarray([n + 1], jnp.int32)
    run = jax.jit(lambda dp, tp, s: drafter.propose(dp, Target(tp, model), s, buffer, lengths, jax.random.key(0),
                                                    SamplingParams.create())[0])
    run(params, target.params, state).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(params, target.params, state).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    from spec_jax.checkpoints import load_target
    from spec_jax.drafters.qwen_mtp import QwenMtpConfig, QwenMtpDrafter, init_mtp_params

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="random:qwen3.5-9b-scaled")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    target = load_target(args.target, dtype=args.dtype)
    head = QwenMtpConfig.from_target(target.cfg)
    drafter, params = QwenMtpDrafter(head, k=args.k), init_mtp_params(head, jax.random.key(1))
    prompts = np.random.default_rng(0).integers(0, target.cfg.vocab_size, (1, args.context)).tolist()
    capacity = args.context + args.new_tokens * (args.k + 1) + args.k + 1
    common = dict(new_tokens=args.new_tokens, capacity=capacity, repeats=args.repeats)
    ar = loop_step_seconds(target, prompts, None, None, **common)
    mtp = loop_step_seconds(target, prompts, drafter, params, **common)
    propose_s = propose_seconds(target, drafter, params, prompts[0], capacity, args.repeats)
    share = propose_s / mtp["step_s"]
    print(f"{args.target} {args.dtype} on {jax.devices()[0].device_kind}, batch 1, context {args.context}: AR step "
          f"{ar['step_s'] * 1e3:.1f} ms; MTP chain of {args.k}: step {mtp['step_s'] * 1e3:.1f} ms = "
          f"{mtp['step_s'] / ar['step_s']:.2f}x AR; its propose alone {propose_s * 1e3:.1f} ms ({share:.0%} of the step)")
    print(json.dumps({"ar": ar, "mtp": mtp, "propose_s": propose_s, "drafter_share": share}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

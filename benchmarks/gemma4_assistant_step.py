"""The loop's step with Gemma 4's assistant (`--drafter mtp`) against plain decoding, on a random
Gemma 4 target: a chain of K drafts and a tree of N nodes, and the drafter's share of the step.

    python benchmarks/gemma4_assistant_step.py                       # random:gemma-4-e4b, bfloat16 (a GPU)
    python benchmarks/gemma4_assistant_step.py --cpu-size            # the e2b shapes cut to fit this CPU

Random weights accept (almost) nothing, so each step commits about one token: the numbers are
what a step costs (one verify pass of K + 1 or N + 1 tokens plus the drafting), and a trained
assistant with acceptance length tau runs at about tau x (AR step / assistant step) of plain
decoding. The drafter's share is its `propose` (or `propose_tree`) alone, jitted on the
target's cache after the prompt, best of --repeats, over the step. The assistant is shaped like a
small Gemma 4 (`--assistant-layers` layers, the last full, the target's KV heads and head sizes;
the published assistants' shapes were not available offline). Step times as in dflash_step.py:
per loop step of the real `generate` loop, prefill removed by difference, best of --repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash_step import loop_step_seconds  # noqa: E402


def cpu_sized(cfg):
    """gemma-4-e2b's layer shapes (width 1536, heads, KV sharing, per-layer embeddings, the
    sliding/full pattern) with 10 of its 35 layers (the last 4 KV-shared) and a 32k vocabulary:
    about 0.4 B parameters, a step this 2-core CPU runs in float32."""
    types = cfg.layer_types[:9] + ("full_attention",)
    return cfg.replace(num_layers=10, layer_types=types, num_kv_shared_layers=4, vocab_size=32768,
                       per_layer_vocab_size=32768)


def shaped_assistant(target_cfg, layers: int, dtype: str):
    from spec_jax.drafters.gemma4_assistant import Gemma4AssistantConfig, init_assistant_params

    types = ("sliding_attention",) * (layers - 1) + ("full_attention",)
    cfg = Gemma4AssistantConfig(
        vocab_size=target_cfg.vocab_size, hidden_size=512, intermediate_size=2048, num_heads=4, layer_types=types,
        head_dim=target_cfg.head_dim, num_kv_heads=target_cfg.num_kv_heads,
        global_head_dim=target_cfg.global_head_dim, num_global_kv_heads=target_cfg.num_global_kv_heads,
        backbone_hidden_size=target_cfg.hidden_size, sliding_window=target_cfg.sliding_window,
        use_ordered_embeddings=True, num_centroids=2048, centroid_top_k=32, dtype=dtype)
    return cfg, init_assistant_params(cfg, jax.random.key(0))


def propose_seconds(target, drafter, params, prompt: list[int], capacity: int, repeats: int) -> float:
    """Seconds of one `propose` / `propose_tree` on the target's cache after `prompt`."""
    import time

    import jax.numpy as jnp

    from spec_jax.models import Decoder, Target
    from spec_jax.sampling import SamplingParams

    model, n = Decoder(target.cfg), len(prompt)
    tokens = jnp.asarray([prompt], jnp.int32)
    out = jax.jit(lambda p, t: model.forward(p, t, jnp.arange(n)[None], model.init_cache(1, capacity)))(
        target.params, tokens)
    cache, state = model.commit(out.cache, jnp.asarray([n - 1])), out.hidden[:, n - 2]
    buffer, lengths = jnp.zeros((1, capacity), jnp.int32).at[:, :n].set(tokens), jnp.asarray([n], jnp.int32)

    def draft(dp, tp, c, s):
        view, key, sampling = Target(tp, model, c), jax.random.key(0), SamplingParams.create()
        if drafter.tree:
            return drafter.propose_tree(dp, view, s, buffer, lengths, key, sampling)[0].tokens
        return drafter.propose(dp, view, s, buffer, lengths, key, sampling)[0]

    run = jax.jit(draft)
    run(params, target.params, cache, state).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(params, target.params, cache, state).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    from spec_jax.checkpoints import LoadedModel, load_target
    from spec_jax.drafters.gemma4_assistant import Gemma4AssistantDrafter
    from spec_jax.models import init_params
    from spec_jax.models.presets import preset_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="random:gemma-4-e4b")
    parser.add_argument("--cpu-size", action="store_true", help="gemma-4-e2b shapes cut to 10 layers, 32k vocab")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tree", type=int, default=16)
    parser.add_argument("--assistant-layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write gemma4_assistant_step.json here")
    args = parser.parse_args(argv)

    if args.cpu_size:
        cfg = cpu_sized(preset_config("gemma-4-e2b", args.dtype))
        target = LoadedModel(cfg=cfg, params=init_params(cfg, jax.random.key(0)), tokenizer=None,
                             chat_template=None, source="random:gemma-4-e2b (cut)")
        name = "gemma-4-e2b shapes, 10 layers, 32k vocab"
    else:
        target, name = load_target(args.target, dtype=args.dtype), args.target
    assistant_cfg, params = shaped_assistant(target.cfg, args.assistant_layers, args.dtype)
    prompts = np.random.default_rng(0).integers(0, target.cfg.vocab_size, (1, args.context)).tolist()
    capacity = args.context + args.new_tokens * (args.k + 1) + args.k + 1
    common = dict(new_tokens=args.new_tokens, capacity=capacity, repeats=args.repeats)
    report = {"kind": "gemma4_assistant_step", "device": str(jax.devices()[0].device_kind),
              "backend": jax.default_backend(), "target": name, "dtype": args.dtype, "context": args.context,
              "assistant": dataclasses.asdict(assistant_cfg), "ar": loop_step_seconds(target, prompts, None, None, **common)}
    ar_ms = report["ar"]["step_s"] * 1e3
    lines = [f"{name} {args.dtype} on {report['device']}, batch 1, context {args.context}: AR step {ar_ms:.1f} ms"]
    for label, tree in (("chain", 0), ("tree", args.tree)):
        drafted = tree or args.k
        mtp = loop_step_seconds(target, prompts, Gemma4AssistantDrafter(assistant_cfg, k=args.k, tree=tree),
                                params, **common)
        propose_s = propose_seconds(target, Gemma4AssistantDrafter(assistant_cfg, k=args.k, tree=tree), params,
                                    prompts[0], capacity, args.repeats)
        share = propose_s / mtp["step_s"]
        report[label] = {"drafts": drafted, "mtp": mtp, "propose_s": propose_s, "drafter_share": share}
        lines.append(f"  {label} of {drafted}: assistant step {mtp['step_s'] * 1e3:.1f} ms = "
                     f"{mtp['step_s'] / report['ar']['step_s']:.2f}x AR; its propose alone "
                     f"{propose_s * 1e3:.1f} ms ({share:.0%} of the step)")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemma4_assistant_step.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

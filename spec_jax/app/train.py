"""`spec-jax train data|text|KIND`: resumable; re-run the same command to continue.

`data` and `text` build datasets; KIND is any drafter kind with a training recipe in
`spec_jax.drafters.registry` (dflash, draft-model, eagle3, medusa, mtp, and any kind registered since).
"""

from __future__ import annotations

import argparse
from typing import Any

from spec_jax.app import inputs
from spec_jax.app.common import add_target_args, log
from spec_jax.drafters import registry

DATA_KINDS = ("data", "text")
HELP = "build self-distillation (or standard-library text) data; train a drafter (any kind with a recipe)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    trainable = registry.trainable()
    p.add_argument("kind", choices=[*DATA_KINDS, *(k.name for k in trainable)],
                   help="data: self-distillation data (the target's own answers); text: standard-library "
                   "source text; " + "; ".join(f"{k.name}: train {k.help}" for k in trainable))
    add_target_args(p)
    p.add_argument("--data", required=True, nargs="+", metavar="NPZ|DIR",
                   help="token dataset: written by `train data|text`, read (several are joined) by the "
                   "others; a path without .npz is a dir of resumable shards (re-run to continue)")
    p.add_argument("--data-sequences", type=int, default=None, metavar="N",
                   help="dflash/draft-model/eagle3: train on N sequences drawn (seeded) from --data instead of all "
                   "(bounds host memory for precomputed features; tau against data amount)")
    p.add_argument("--init-from", metavar="DIR", default=None,
                   help="dflash/draft-model/eagle3/mtp: continue from an exported drafter dir (same shape), e.g. "
                   "an earlier run's drafter/ or the shipped one (mtp: the model's released assistant, or for a "
                   "Qwen3.5 / Qwen3-Next head the target's own dir), "
                   "instead of a fresh init; with a larger --layers (dflash/draft-model) the extra layers "
                   "start as the identity")
    p.add_argument("--shard-prompts", type=int, default=256, help="data: prompts per shard")
    p.add_argument("--out", metavar="DIR", help="run dir: checkpoints, log, curve, drafter/")
    p.add_argument("--num-prompts", type=int, default=384, help="data: prompts to answer")
    p.add_argument("--answer-tokens", type=int, default=192, help="data: max tokens per answer")
    p.add_argument("--generate-batch", type=int, default=32, help="data: prompts answered per batch")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="data: 0 = greedy answers; > 0 samples them (use another --seed per sample set)")
    p.add_argument("--text-tokens", type=int, default=1_000_000,
                   help="text: tokens of standard-library source to cut into --seq-len pieces")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=320)
    p.add_argument("--learning-rate", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--block-size", type=int, default=8, help="dflash: block size (K = block - 1)")
    p.add_argument("--layers", type=int, default=None, help="drafter layers (default: eagle3 1, others 2; medusa: residual blocks per "
                   "head, default 1; mtp: a fresh assistant's, the last full attention)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle3/dflash: draft vocabulary size, the data's most frequent answer tokens "
                        "(default: eagle3 8192; dflash the target's whole vocabulary through its LM head)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="eagle3: training steps per pair fed the drafter's own features")
    p.add_argument("--k", type=int, default=4, help="eagle3/mtp: drafts per verify step (mtp: the chained drafts the loss scores; eval and "
                   "export); medusa: heads (drafts per step)")
    p.add_argument("--hidden", type=int, default=256, help="draft-model, mtp (a fresh assistant): width")
    p.add_argument("--anchors", type=int, default=8,
                   help="dflash: blocks per sequence per step; mtp: draft chains per sequence per step")
    p.add_argument("--answer-positions", type=int, default=64,
                   help="draft-model/medusa: answer positions per sequence that get the losses")
    p.add_argument("--kl-weight", type=float, default=None,
                   help="weight of KL to the target's logits (default: dflash 0, draft-model 1)")
    p.add_argument("--teacher-labels", action="store_true",
                   help="dflash: labels are the target's greedy predictions (for `train text` data)")
    p.add_argument("--target-features", choices=["auto", "precompute", "precompute-bf16", "per-step"],
                   default="auto",
                   help="precompute the frozen target's features once (host memory; precompute-bf16 stores "
                   "them in bfloat16, half the memory) or run it in every step; auto: precompute on CPU "
                   "when under 4 GB (float32, else bfloat16)")
    p.add_argument("--feature-cache", default=None,
                   help="where precomputed target features are kept, memory-mapped, one store per data file or "
                   "shard (default OUT/target_features): an interrupted pass resumes there, and a later run "
                   "with the same target, --seq-len and layers reuses every data part it shares (runs can "
                   "share one directory)")
    p.add_argument("--eval-prompts", type=int, default=40,
                   help="held-out tau on HumanEval[:N] (N <= 40; never trained on); 0: no held-out tau (the "
                   "run compiles no decoding loop, and the curve shows loss and accuracy only)")
    p.add_argument("--eval-tokens", type=int, default=64, help="tokens generated per held-out prompt")
    p.add_argument("--eval-every", type=int, default=250, help="held-out tau every N steps")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.kind != "data" and args.dtype == "bfloat16":
        raise inputs.UsageError(
            f"train {args.kind} keeps the frozen target in float32 (its features feed the loss); "
            "drop --dtype bfloat16 (it applies to `train data` only)."
        )
    cfg = _check_data_args(args) if args.kind in DATA_KINDS else _check_train_args(args)
    # auto: generating the data in bfloat16 on GPU/TPU is fine; training features stay float32.
    dtype = inputs.resolve_dtype(args.dtype) if args.kind == "data" else "float32"
    target = inputs.load_target_or_fail(args.target, dtype)
    if args.kind in DATA_KINDS:
        _build_data(args, target)
        return None
    from spec_jax.training.run import train_drafter

    dataset = _training_data(args)
    recipe = registry.get(args.kind).recipe_class().from_flags(target, args)
    _, _, result = train_drafter(
        recipe, target, dataset, args.out, cfg, eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens, features=args.target_features, feature_cache=args.feature_cache,
        progress=not args.no_progress, init_from=args.init_from,
    )
    log(f"{result.summary}; held-out {result.evals[-1:]}; drafter in {args.out}/drafter")
    return None


def _check_data_args(args: argparse.Namespace) -> None:
    """`train data|text` flags, checked before the target loads or anything is written."""
    from spec_jax.decoding.validation import SEED_MAX, check_int
    from spec_jax.training import data as data_lib

    if len(args.data) != 1:
        raise inputs.UsageError(f"train {args.kind} writes one dataset: give one --data path.")
    if args.kind == "data":
        data_lib.check_generation_settings(args.num_prompts, args.answer_tokens, args.generate_batch,
                                           args.shard_prompts, args.temperature)
    else:
        check_int("--text-tokens", args.text_tokens, minimum=1)
        check_int("--seq-len", args.seq_len, minimum=2)
    check_int("--seed", args.seed, minimum=0, maximum=SEED_MAX)


def _check_train_args(args: argparse.Namespace) -> Any:
    """The TrainConfig of `train KIND`, its sizes checked before the target loads."""
    from spec_jax.decoding.validation import check_int
    from spec_jax.training.trainer import TrainConfig

    if not args.out:
        raise inputs.UsageError(
            f"train {args.kind} needs --out DIR (checkpoints and the exported drafter)."
        )
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed,
        save_every=args.save_every, eval_every=args.eval_every,
    )
    sizes = [("--layers", args.layers, 1), ("--draft-vocab", args.draft_vocab, 2),
             ("--data-sequences", args.data_sequences, 2), ("--block-size", args.block_size, 2),
             ("--anchors", args.anchors, 1), ("--eval-prompts", args.eval_prompts, 0),
             ("--eval-tokens", args.eval_tokens, 1), ("--k", args.k, 1), ("--hidden", args.hidden, 1),
             ("--ttt-steps", args.ttt_steps, 1), ("--answer-positions", args.answer_positions, 1)]
    for flag, value, minimum in sizes:
        if value is not None:  # None: the command's default
            check_int(flag, value, minimum=minimum)
    return cfg


def _build_data(args: argparse.Namespace, target: Any) -> None:
    """`train data` (the target's own answers) or `train text` (standard-library source)."""
    from spec_jax.training import data as data_lib

    path = args.data[0]
    # A path without .npz is a shard dir: resumable, re-run the same command to continue.
    sharded = not str(path).endswith(".npz")
    if args.kind == "text":
        if sharded:
            raise inputs.UsageError("train text writes a single file: give --data NAME.npz.")
        if target.tokenizer is None:
            raise inputs.UsageError(
                f"{target.source} ships no tokenizer, so source text cannot be encoded; pass a "
                "checkpoint with tokenizer files (or the default model)."
            )
        dataset = data_lib.stdlib_text_dataset(target.tokenizer, args.seq_len, args.text_tokens, args.seed)
    else:
        prompts = data_lib.training_prompts(args.num_prompts, seed=args.seed)
        dataset = data_lib.build_dataset(
            target, prompts, max_new_tokens=args.answer_tokens, batch_size=args.generate_batch,
            temperature=args.temperature, seed=args.seed, progress=not args.no_progress,
            shard_dir=path if sharded else None, shard_prompts=args.shard_prompts,
        )
    if not sharded:
        dataset.save(path)
    log(f"wrote {path}: {len(dataset)} sequences, {dataset.num_tokens} tokens")


def _training_data(args: argparse.Namespace) -> Any:
    """--data joined, or --data-sequences of it drawn (seeded)."""
    from spec_jax.training import data as data_lib

    dataset = data_lib.TokenDataset.concatenate([data_lib.TokenDataset.load(d) for d in args.data])
    if args.data_sequences is not None:
        if not 2 <= args.data_sequences <= len(dataset):
            raise inputs.UsageError(
                f"--data-sequences {args.data_sequences}: --data holds {len(dataset)} sequences; pass 2..{len(dataset)}."
            )
        _, dataset = dataset.split(args.data_sequences / len(dataset), args.seed)
    return dataset

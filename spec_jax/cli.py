"""`spec-jax generate | bench | info`.

    spec-jax generate "Write a Python function that checks whether a number is prime."
    spec-jax generate --prompt-ids 1,2,3 --drafter ngram --k 4 --json
    spec-jax bench --drafters ngram,self --k 2,4,8 --num-prompts 10 --out results/
    spec-jax info --target path/to/hf_dir

Results go to stdout (with --json exactly one JSON object); logs and progress go to stderr.
A user error prints one `error: ...` line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Sequence

EXIT_USAGE = 2


def log(*parts: Any) -> None:
    print("spec-jax:", *parts, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- arguments
def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default=None,
        help="HF checkpoint dir, hub id, .gguf file or random:PRESET (random weights, e.g. "
        "random:llama-3.2-1b; for speed measurements). Default: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weights and caches; auto = float32 on CPU, bfloat16 on GPU/TPU",
    )


def _add_sampling(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS / end of turn")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap text prompts in the chat template (default on; never for --prompt-ids)",
    )
    p.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard over a device mesh")


def _add_prompts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-file",
        default=None,
        metavar="JSONL",
        help='one JSON object per line with "prompt", "messages" or "prompt_ids"',
    )
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="1,2,3",
        help="a prompt as token ids (repeat the flag for more prompts)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spec-jax", description="Speculative decoding for JAX/Flax language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench,info,train}")

    gen = sub.add_parser("generate", help="generate completions (all prompts as one batch)")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (a user message)")
    _add_prompts(gen)
    _add_target(gen)
    _add_sampling(gen)
    gen.add_argument(
        "--drafter",
        nargs="+",
        default=None,
        metavar="KIND [PATH]",
        help="none | ngram | self | draft-model [PATH] | dflash [PATH]. Default: the shipped DFlash "
        "drafter for the default model, none for other targets. Without PATH, draft-model and "
        "dflash use the drafters shipped for the default model.",
    )
    gen.add_argument("--k", type=int, default=None, help="drafts per step (default: the drafter's)")
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    bench = sub.add_parser("bench", help="AR vs drafters: tokens/s, speedup, acceptance")
    _add_target(bench)
    _add_prompts(bench)
    bench.add_argument("--num-prompts", type=int, default=10, help="first N HumanEval prompts (default 10)")
    bench.add_argument(
        "--drafters",
        default="ngram",
        help="comma list of ngram, self, draft-model=PATH, dflash=PATH (default ngram)",
    )
    bench.add_argument("--k", default=None, help="comma list of K values to sweep, e.g. 2,4,8")
    bench.add_argument("--batch-size", type=int, default=1)
    _add_sampling(bench)
    bench.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    bench.add_argument("--out", default=None, metavar="DIR", help="write results.json and bench.png here")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--roofline",
        action="store_true",
        help="instead of prompts: copy bandwidth, AR step vs the bandwidth floor, and the cost of "
        "verifying 1..64 tokens in one pass (uses --target, --dtype, --batch-size, --out; the AR "
        "step is timed over --max-new-tokens steps)",
    )
    bench.add_argument("--context", type=int, default=256, help="roofline: tokens already in the cache")
    bench.add_argument(
        "--verify-tokens", default="1,2,4,8,16,32,64", help="roofline: comma list of tokens per verify pass"
    )

    info = sub.add_parser("info", help="parameter counts and KV-cache bytes per token")
    _add_target(info)
    info.add_argument("--drafter", nargs="+", default=["none"], metavar="KIND [PATH]")
    info.add_argument("--k", type=int, default=None)
    info.add_argument("--json", action="store_true")

    train = sub.add_parser("train", help="build self-distillation data; train DFlash or a draft model")
    train.add_argument("kind", choices=["data", "dflash", "draft-model"])
    _add_target(train)
    train.add_argument("--data", required=True, metavar="NPZ",
                       help="token dataset: written by `train data`, read by the others")
    train.add_argument("--out", metavar="DIR", help="run dir: checkpoints, log, curve, drafter/")
    train.add_argument("--num-prompts", type=int, default=384, help="data: prompts to answer")
    train.add_argument("--answer-tokens", type=int, default=192, help="data: max tokens per answer")
    train.add_argument("--generate-batch", type=int, default=32, help="data: prompts answered per batch")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=320)
    train.add_argument("--learning-rate", type=float, default=6e-4)
    train.add_argument("--warmup-steps", type=int, default=50)
    train.add_argument("--block-size", type=int, default=8, help="dflash: block size (K = block - 1)")
    train.add_argument("--layers", type=int, default=2, help="drafter layers")
    train.add_argument("--hidden", type=int, default=256, help="draft-model: width")
    train.add_argument("--anchors", type=int, default=8, help="dflash: blocks per sequence per step")
    train.add_argument("--answer-positions", type=int, default=64,
                       help="draft-model: answer positions per sequence that get the losses")
    train.add_argument("--kl-weight", type=float, default=None,
                       help="weight of KL to the target's logits (default: dflash 0, draft-model 1)")
    train.add_argument("--eval-every", type=int, default=250, help="held-out tau every N steps")
    train.add_argument("--save-every", type=int, default=200)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--no-progress", action="store_true")
    return parser


def _names_checkpoint(word: str) -> bool:
    from spec_jax.checkpoints.hf import looks_like_hub_id

    return os.path.exists(word) or looks_like_hub_id(word) or (os.sep in word and " " not in word)


def _split_drafter_arg(values: Sequence[str] | None, k: int | None, target_arg: str | None = None):
    """`--drafter KIND [PATH]` takes one or two words; words past what KIND needs are prompts
    (argparse hands `--drafter ngram "some prompt"` all to --drafter)."""
    from spec_jax.launch import DRAFTER_KINDS_WITH_PATH, default_drafter_spec, make_drafter_spec

    if values is None:
        return default_drafter_spec(target_arg, k), []

    kind, rest = values[0], list(values[1:])
    # The word after draft-model/dflash is its checkpoint when it names one (an existing path or
    # a hub id); otherwise it is a prompt and the shipped drafter is meant.
    takes_path = kind in DRAFTER_KINDS_WITH_PATH and rest and _names_checkpoint(rest[0])
    path = rest.pop(0) if takes_path else None
    return make_drafter_spec(kind, path, k), rest


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from spec_jax.decoding.sampling import validate_sampling

    validate_sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def _collect_prompts(args: argparse.Namespace, positional: Sequence[str]):
    from spec_jax.launch import Prompt, parse_prompt_ids, read_prompt_file

    prompts = [Prompt(text=t, source=f"prompt argument {i + 1}") for i, t in enumerate(positional)]
    if args.prompt_file:
        prompts += read_prompt_file(args.prompt_file)
    prompts += [parse_prompt_ids(t, f"--prompt-ids #{i + 1}") for i, t in enumerate(args.prompt_ids)]
    return prompts


# --------------------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> dict[str, Any] | None:
    from spec_jax import launch
    from spec_jax.decoding.generate import generate

    spec, extra_prompts = _split_drafter_arg(args.drafter, args.k, args.target)
    prompts = _collect_prompts(args, list(args.prompts) + extra_prompts)
    if not prompts:
        raise launch.UsageError("no prompt given: pass PROMPT text, --prompt-file or --prompt-ids.")
    sampling = _sampling_kwargs(args)

    t0 = time.perf_counter()
    target = launch.load_target_or_fail(args.target, args.dtype)
    log(f"loaded {target.source} in {time.perf_counter() - t0:.1f}s")
    prompt_ids = launch.encode_prompts(target, prompts, args.chat)
    drafter, drafter_params = launch.build_drafter(spec, target)
    launch.check_fits(target, prompt_ids, args.max_new_tokens, launch.drafter_k(drafter))
    stop_ids = launch.stop_ids_for(target, launch.uses_chat(prompts, args.chat), args.ignore_eos)
    mesh = launch.mesh_kwargs(args.mesh, target)

    log(f"generating: {len(prompt_ids)} prompt(s), drafter {spec.kind}, K={launch.drafter_k(drafter)}")
    result = generate(
        target,
        prompt_ids,
        drafter,
        drafter_params,
        stop_ids=stop_ids,
        ignore_eos=args.ignore_eos,
        **sampling,
        **mesh,
    )
    tok = target.tokenizer
    texts = [tok.decode(g, skip_special_tokens=True) if tok is not None else None for g in result.generated_ids]
    payload = {
        "results": [
            {
                "generated_ids": ids,
                "text": text,
                "finish_reason": reason,
                "prompt_length": len(p),
                "stats": row.to_dict(),
            }
            for ids, text, reason, p, row in zip(
                result.generated_ids, texts, result.finish_reasons, prompt_ids, result.row_stats
            )
        ],
        "timing": {
            "compile_s": result.compile_s,
            "generate_s": result.generate_s,
            "tokens_per_second": result.tokens_per_second,
        },
        "stats": result.stats.to_dict(),
        "target": target.source,
        "drafter": spec.label if spec.kind != "none" else "none",
        "k": launch.drafter_k(drafter),
    }
    if args.json:
        return payload
    for i, (ids, text) in enumerate(zip(result.generated_ids, texts)):
        if len(texts) > 1:
            print(f"--- [{i}] ({result.finish_reasons[i]})")
        print(text if text is not None else " ".join(map(str, ids)))
    s = result.stats
    log(
        f"{result.num_generated} tokens in {result.generate_s:.2f}s = {result.tokens_per_second:.1f} tok/s"
        f" (compile {result.compile_s:.1f}s); steps {s.steps}, tau {s.tau:.2f}, "
        f"accepted {s.accepted}/{s.drafted} drafts"
    )
    return None


# --------------------------------------------------------------------------- bench
def _parse_positive_ints(text: str, flag: str, example: str) -> list[int]:
    """ "2,4,8" -> [2, 4, 8]; anything else is a usage error naming `flag`."""
    from spec_jax.launch import UsageError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a comma list of integers, e.g. {example}.") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} values must be integers >= 1, got {text!r}.")
    return values


def _parse_ks(text: str | None) -> list[int | None]:
    return [None] if text is None else list(_parse_positive_ints(text, "--k", "2,4,8"))


def _emit(args: argparse.Namespace, report: dict[str, Any], write: Any, show: Any) -> dict[str, Any] | None:
    """--out DIR: write the report's files; --json: return it for printing; else print a table."""
    if args.out:
        log("wrote " + ", ".join(str(p) for p in write(report, args.out)))
    if args.json:
        return report
    show(report)
    return None


def cmd_bench(args: argparse.Namespace) -> dict[str, Any] | None:
    from spec_jax import bench, launch

    if args.roofline:
        return _roofline(args)
    sampling = _sampling_kwargs(args)
    ks = _parse_ks(args.k)
    kinds = [d.strip() for d in args.drafters.split(",") if d.strip()]
    specs = [launch.parse_drafter_spec(d) for d in kinds if d != "none"]
    if args.batch_size < 1:
        raise launch.UsageError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.prompt_file or args.prompt_ids:
        prompts = _collect_prompts(args, [])
        prompt_set = args.prompt_file or "--prompt-ids"
    else:
        if args.num_prompts < 1:
            raise launch.UsageError(f"--num-prompts must be >= 1, got {args.num_prompts}.")
        prompts = bench.humaneval_prompts(args.num_prompts)
        prompt_set = f"HumanEval[:{args.num_prompts}]"

    target = launch.load_target_or_fail(args.target, args.dtype)
    log(f"loaded {target.source}")
    prompt_ids = launch.encode_prompts(target, prompts, args.chat)
    stop_ids = launch.stop_ids_for(target, launch.uses_chat(prompts, args.chat), args.ignore_eos)
    methods = bench.expand_methods(specs, ks)
    report = bench.run_bench(
        target,
        prompt_ids,
        methods,
        batch_size=args.batch_size,
        stop_ids=stop_ids,
        ignore_eos=args.ignore_eos,
        progress=not args.no_progress,
        extra_generate_kwargs=launch.mesh_kwargs(args.mesh, target),
        prompt_set=prompt_set,
        **sampling,
    )
    return _emit(args, report, bench.write_outputs, bench.print_table)


def _roofline(args: argparse.Namespace) -> dict[str, Any] | None:
    from spec_jax import launch, roofline

    verify_tokens = _parse_positive_ints(args.verify_tokens, "--verify-tokens", "1,4,16")
    if args.batch_size < 1 or args.context < 1:
        raise launch.UsageError("--batch-size and --context must be >= 1.")
    if args.mesh:
        raise launch.UsageError("--roofline measures one device; drop --mesh.")
    target = launch.load_target_or_fail(args.target, args.dtype)
    log(f"loaded {target.source} ({target.cfg.dtype})")
    report = roofline.run_roofline(
        target,
        batch=args.batch_size,
        context=args.context,
        verify_tokens=verify_tokens,
        new_tokens=max(2, args.max_new_tokens),
        progress=not args.no_progress,
    )
    return _emit(args, report, roofline.write_roofline, roofline.print_roofline)


# --------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace) -> dict[str, Any] | None:
    from spec_jax import launch
    from spec_jax.models.weights import count_params, model_weight_specs

    spec, extra = _split_drafter_arg(args.drafter, args.k)
    if extra:
        raise launch.UsageError(f"unexpected arguments {extra!r} after --drafter.")
    target = launch.load_target_or_fail(args.target, args.dtype)
    cfg = target.cfg
    itemsize = _itemsize(cfg.dtype)
    info: dict[str, Any] = {
        "target": {
            "source": target.source,
            "architecture": cfg.architecture,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "tied_embeddings": cfg.tie_embeddings,
            "dtype": cfg.dtype,
            "params": count_params(model_weight_specs(cfg)),
            "kv_bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize,
            "has_tokenizer": target.tokenizer is not None,
            "has_chat_template": target.chat_template is not None,
        }
    }
    drafter, _ = launch.build_drafter(spec, target)
    if drafter is not None:
        info["drafter"] = _drafter_info(spec, drafter, target)
    if args.json:
        return info
    for section, values in info.items():
        print(f"{section}:")
        for key, value in values.items():
            if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
                value = f"{value:,}"
            print(f"  {key:20s} {value}")
    return None


def _itemsize(dtype: str) -> int:
    import numpy as np

    import jax.numpy as jnp

    return int(np.dtype(jnp.dtype(dtype)).itemsize)


def _drafter_info(spec: Any, drafter: Any, target: Any) -> dict[str, Any]:
    from spec_jax.models.weights import count_params, model_weight_specs

    out: dict[str, Any] = {"kind": spec.kind, "k": int(drafter.k)}
    cfg = getattr(drafter, "cfg", None)
    if cfg is None:  # n-gram: no weights, no cache
        out.update(params=0, kv_bytes_per_token=0)
        return out
    if spec.kind in ("self", "draft-model"):
        out["params"] = count_params(model_weight_specs(cfg))
    else:  # DFlash: its own specs; it borrows the target's embedding and LM head
        from spec_jax.drafters.dflash import dflash_weight_specs

        out["params"] = count_params(dflash_weight_specs(cfg))
        out["target_layer_ids"] = list(cfg.target_layer_ids)
        out["block_size"] = cfg.block_size
    out["kv_bytes_per_token"] = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _itemsize(cfg.dtype)
    if spec.path:
        out["source"] = spec.path
    return out


def cmd_train(args: argparse.Namespace) -> dict[str, Any] | None:
    """`spec-jax train data|dflash|draft-model`: resumable; re-run the same command to continue."""
    from spec_jax import launch
    from spec_jax.training import data as data_lib
    from spec_jax.training import run
    from spec_jax.training.trainer import TrainConfig

    if args.kind != "data" and args.dtype == "bfloat16":
        raise launch.UsageError(
            "train dflash|draft-model keeps the frozen target in float32 (its features feed the loss); "
            "drop --dtype bfloat16 (it applies to `train data` only)."
        )
    # auto: generating the data in bfloat16 on GPU/TPU is fine; training features stay float32.
    dtype = launch.resolve_dtype(args.dtype) if args.kind == "data" else "float32"
    target = launch.load_target_or_fail(args.target, dtype)
    progress = not args.no_progress
    if args.kind == "data":
        prompts = data_lib.training_prompts(args.num_prompts, seed=args.seed)
        dataset = data_lib.build_dataset(
            target, prompts, max_new_tokens=args.answer_tokens, batch_size=args.generate_batch,
            seed=args.seed, progress=progress,
        )
        dataset.save(args.data)
        log(f"wrote {args.data}: {len(dataset)} sequences, {dataset.num_tokens} tokens")
        return None
    if not args.out:
        raise ValueError("train dflash|draft-model needs --out DIR (checkpoints and the exported drafter).")
    dataset = data_lib.TokenDataset.load(args.data)
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed,
        save_every=args.save_every, eval_every=args.eval_every,
    )
    if args.kind == "dflash":
        dflash_cfg = run.smollm2_dflash_config(target.cfg, args.block_size, args.layers)
        _, _, result = run.train_dflash(
            target, dataset, args.out, cfg, dflash_cfg, num_anchors=args.anchors,
            kl_weight=args.kl_weight or 0.0, progress=progress,
        )
    else:
        student = run.small_draft_config(target.cfg, args.hidden, args.layers)
        _, _, result = run.train_draft_model(
            target, dataset, args.out, cfg, student,
            kl_weight=1.0 if args.kl_weight is None else args.kl_weight,
            positions=args.answer_positions, progress=progress,
        )
    log(f"trained {result.state.step} steps in {result.seconds:.0f}s; held-out {result.evals[-1:]}; "
        f"drafter in {args.out}/drafter")
    return None


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "info": cmd_info, "train": cmd_train}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed usage + "error: ..." already
        return int(e.code or 0)
    from spec_jax.checkpoints import CheckpointError

    wants_json = getattr(args, "json", False)
    from spec_jax.sharding.distributed import initialize_distributed, is_main_process

    try:
        # Multi-host (TPU pod slice, or SPEC_JAX_COORDINATOR for GPU hosts): every process runs
        # the same program over the global mesh; only process 0 prints.
        if initialize_distributed() and not is_main_process():
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of this process
        # Library code that prints must not corrupt the one JSON object on stdout.
        with contextlib.redirect_stdout(sys.stderr) if wants_json else contextlib.nullcontext():
            payload = COMMANDS[args.command](args)
    except (CheckpointError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    if payload is not None:
        json.dump(payload, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

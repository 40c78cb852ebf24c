"""What the `spec-jax` commands share: logging, the common flags, prompts from flags, output."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Sequence

from spec_jax.app.inputs import (
    DrafterSpec,
    Prompt,
    UsageError,
    check_text,
    default_drafter_spec,
    parse_drafter_spec,
    parse_prompt_ids,
    read_prompt_file,
)
from spec_jax.drafters import registry


def log(*parts: Any) -> None:
    print("spec-jax:", *parts, file=sys.stderr, flush=True)


def add_target_args(p: argparse.ArgumentParser) -> None:
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


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
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


def add_prompt_args(p: argparse.ArgumentParser) -> None:
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


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags for `generate`, checked before the target loads (the same checks
    `generate` runs; a value out of range is one `error:` line naming it)."""
    from spec_jax.decoding.validation import check_sampling

    return check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)


def collect_prompts(args: argparse.Namespace, positional: Sequence[str]):
    prompts = [Prompt(text=check_text(t, f"prompt argument {i + 1}"), source=f"prompt argument {i + 1}")
               for i, t in enumerate(positional)]
    if args.prompt_file:
        prompts += read_prompt_file(args.prompt_file)
    prompts += [parse_prompt_ids(t, f"--prompt-ids #{i + 1}") for i, t in enumerate(args.prompt_ids)]
    return prompts


def parse_positive_ints(text: str, flag: str, example: str) -> list[int]:
    """ "2,4,8" -> [2, 4, 8]; anything else is a usage error naming `flag`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a comma list of integers, e.g. {example}.") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} values must be integers >= 1, got {text!r}.")
    return values


def k_value(text: str) -> int | str:
    """--k: drafts per step (an integer), or "adaptive" (each step picks its depth)."""
    if text.strip().lower() == "adaptive":
        return "adaptive"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected drafts per step (an integer) or 'adaptive', got {text!r}") from None


def emit(args: argparse.Namespace, report: dict[str, Any], write: Any, show: Any) -> dict[str, Any] | None:
    """--out DIR: write the report's files; --json: return it for printing; else print a table."""
    if args.out:
        log("wrote " + ", ".join(str(p) for p in write(report, args.out)))
    if args.json:
        return report
    show(report)
    return None


def add_drafter_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    """--drafter, --k and --tree, their help read from the drafter registry."""
    p.add_argument(
        "--drafter",
        default=None,
        metavar="KIND[=PATH]",
        help=f"{registry.synopsis()}, or a model drafter with prompt lookup in front: "
        f"{' | '.join(registry.lookup_names())}[=PATH] (one word; a checkpoint follows '='), or the "
        f"suffix lookup across requests in front: {' | '.join(registry.lookup_names(registry.SUFFIX))}. "
        f"{default_help} Kinds: {registry.described()}.",
    )
    p.add_argument("--k", type=k_value, default=None, metavar="K|adaptive",
                   help="drafts per step (default: the drafter's); 'adaptive': each step picks its depth "
                   "among 0 (a plain step), 2, about K/2 and K (the drafter's K) from recent acceptance "
                   "and measured step times (a chain: --tree 0)")
    p.add_argument(
        "--tree", type=int, default=None, metavar="N",
        help="verify a token tree of N draft nodes per step (0 = a chain of K, the default; K bounds "
        f"its depth): {', '.join(registry.tree_kinds())} and their +ngram forms",
    )


def drafter_spec_from_args(
    args: argparse.Namespace, prompts: Sequence[str] = (), batch: int = 1, adaptive_ok: bool = False,
    engine: bool = False,
) -> DrafterSpec:
    """`--drafter KIND` or `--drafter KIND=PATH`; without --drafter, `default_drafter_spec` for
    `batch` prompts decoded together at the command's --temperature (`engine`: for `serve`'s
    engine of `batch` slots) (adaptive depth by default where the command runs it: `adaptive_ok`).

    The old two-word form `--drafter dflash PATH` cannot be told apart from a prompt, so it is
    refused (naming the one-word form) when the word after it is an existing path."""
    tree = getattr(args, "tree", None)
    if tree is not None and tree < 0:
        raise UsageError(f"--tree must be >= 0 draft nodes (0 = a chain), got {tree}.")
    adaptive = args.k == "adaptive"
    k = None if adaptive else args.k
    if adaptive and not adaptive_ok:
        raise UsageError("--k adaptive is for generate, bench and serve; pass a number of drafts per step.")
    if adaptive and tree is None:  # a chain unless --tree asks for trees (their budget scales with depth)
        tree = 0
    if args.drafter is None:
        spec = default_drafter_spec(args.target, k, batch=batch,
                                    temperature=getattr(args, "temperature", 0.0), engine=engine)
        spec = spec if tree is None else dataclasses.replace(spec, tree=tree)
        # The default drafter picks its depth per step where the measured table says so (and
        # the command can run it), unless --k pins K.
        return dataclasses.replace(spec, adaptive=(adaptive or (spec.adaptive and adaptive_ok)) and spec.kind != "none")
    spec = parse_drafter_spec(args.drafter, k)
    spec = dataclasses.replace(spec, tree=tree, adaptive=adaptive and spec.kind != "none")
    if registry.get(spec.kind).takes_path and spec.path is None and prompts:
        if os.path.exists(prompts[0]):
            raise UsageError(
                f"--drafter takes one word: write --drafter {spec.kind}={prompts[0]} to use that "
                "checkpoint (a word after --drafter is a prompt)."
            )
    return spec

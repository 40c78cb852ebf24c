"""`spec-jax generate`: completions for all prompts as one batch.

    spec-jax generate "Write a Python function that checks whether a number is prime."
    spec-jax generate --prompt-ids 1,2,3 --drafter ngram --k 4 --json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from spec_jax.app import inputs
from spec_jax.app.common import (
    add_drafter_arg,
    add_prompt_args,
    add_sampling_args,
    add_target_args,
    collect_prompts,
    drafter_spec_from_args,
    log,
    sampling_kwargs,
)

HELP = "generate completions (all prompts as one batch)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (a user message)")
    add_prompt_args(p)
    add_target_args(p)
    add_sampling_args(p)
    add_drafter_arg(
        p,
        "Default: the drafter measured fastest for the default model on this backend, none for "
        "other targets. Without PATH, draft-model and dflash use the drafters shipped for the "
        "default model.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    from spec_jax.decoding.generate import generate

    prompts = collect_prompts(args, args.prompts)
    if not prompts:
        raise inputs.UsageError("no prompt given: pass PROMPT text, --prompt-file or --prompt-ids.")
    spec = drafter_spec_from_args(args, args.prompts, batch=len(prompts))
    sampling = sampling_kwargs(args)

    t0 = time.perf_counter()
    target = inputs.load_target_or_fail(args.target, args.dtype)
    log(f"loaded {target.source} in {time.perf_counter() - t0:.1f}s")
    prompt_ids = inputs.encode_prompts(target, prompts, args.chat)
    drafter, drafter_params = inputs.build_drafter(spec, target)
    mesh = inputs.mesh_kwargs(args.mesh, target)

    log(f"generating: {len(prompt_ids)} prompt(s), drafter {spec.kind}, K={inputs.drafter_k(drafter)}"
        + (f" ({spec.reason})" if spec.reason else ""))
    result = generate(
        target,
        prompt_ids,
        drafter,
        drafter_params,
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
        "drafter_reason": spec.reason or "named by --drafter",
        "k": inputs.drafter_k(drafter),
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

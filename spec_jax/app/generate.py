"""`spec-jax generate`: completions for all prompts as one batch.

    spec-jax generate "Write a Python function that checks whether a number is prime."
    spec-jax generate --prompt-ids 1,2,3 --drafter ngram --k 4 --json
    spec-jax generate --stream "Tell me a story."    # text appears as it is accepted
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
from spec_jax.drafters import registry

HELP = "generate completions (all prompts as one batch)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (a user message)")
    add_prompt_args(p)
    add_target_args(p)
    add_sampling_args(p)
    add_drafter_arg(
        p,
        "Default: the drafter measured fastest for the default model on this backend, none for "
        f"other targets. Without PATH, {' and '.join(k.name for k in registry.kinds() if k.shipped)} "
        "use the drafters shipped for the default model.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--stream",
        action="store_true",
        help="print the answer as it is generated (one prompt; not with --json)",
    )


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    from spec_jax.decoding.generate import generate

    prompts = collect_prompts(args, args.prompts)
    if not prompts:
        raise inputs.UsageError("no prompt given: pass PROMPT text, --prompt-file or --prompt-ids.")
    if args.stream and args.json:
        raise inputs.UsageError("--stream prints text as it comes and --json one object at the end; pick one.")
    if args.stream and len(prompts) > 1:
        raise inputs.UsageError(
            f"--stream prints one answer as it comes, got {len(prompts)} prompts; pass one prompt "
            "(or drop --stream to generate them all as one batch)."
        )
    # The stream does not run the adaptive depth on a mesh yet: there the default pins K.
    spec = drafter_spec_from_args(args, args.prompts, batch=len(prompts),
                                  adaptive_ok=not (args.stream and args.mesh) or args.k == "adaptive")
    sampling = sampling_kwargs(args)

    t0 = time.perf_counter()
    target = inputs.load_target_or_fail(args.target, args.dtype)
    log(f"loaded {target.source} in {time.perf_counter() - t0:.1f}s")
    prompt_ids = inputs.encode_prompts(target, prompts, args.chat)
    drafter, drafter_params = inputs.build_drafter(spec, target)
    mesh = inputs.mesh_kwargs(args.mesh, target)

    depth = f"adaptive, at most {inputs.drafter_k(drafter)}" if spec.adaptive else inputs.drafter_k(drafter)
    log(f"generating: {len(prompt_ids)} prompt(s), drafter {spec.kind}, K={depth}"
        + (f" ({spec.brief or spec.reason}; the measurements: --json)" if spec.reason else ""))
    if spec.adaptive:  # each step picks its depth, the drafter's K the largest
        sampling = dict(sampling, k=spec.generate_k)
    if args.stream:
        return _stream(args, target, prompt_ids, drafter, drafter_params, sampling, mesh)
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
    if args.json:
        return _payload(result, texts, prompt_ids, target, spec, drafter)
    for i, (ids, text) in enumerate(zip(result.generated_ids, texts)):
        if len(texts) > 1:
            print(f"--- [{i}] ({result.finish_reasons[i]})")
        print(text if text is not None else " ".join(map(str, ids)))
    s = result.stats
    log(
        f"{result.num_generated} tokens in {result.generate_s:.2f}s = {result.tokens_per_second:.1f} tok/s"
        f" (compile {result.compile_s:.1f}s); steps {s.steps}, tau {s.tau:.2f}, "
        f"accepted {s.accepted}/{s.drafted} drafts"
        + (f"; steps per depth {result.depth_counts}, {result.shadow_probes} shadow probes"
           if result.depth_counts is not None else "")
    )
    return None


def _payload(result: Any, texts: list, prompt_ids: list, target: Any, spec: Any, drafter: Any) -> dict[str, Any]:
    """--json: the whole result as one JSON-ready object."""
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
    if result.depth_counts is not None:  # --k adaptive: steps taken at each depth
        payload["depth_counts"] = result.depth_counts
        payload["shadow_probes"] = result.shadow_probes
        payload["depth_costs"] = result.depth_costs
    return payload


def _stream(args, target, prompt_ids, drafter, drafter_params, sampling, mesh) -> None:
    """--stream: print each chunk's text as it comes (ids when the target has no tokenizer)."""
    import sys

    from spec_jax.decoding.stream import IncrementalDetokenizer, generate_stream

    tok = target.tokenizer
    detok = IncrementalDetokenizer(tok) if tok is not None else None
    updates = generate_stream(target, prompt_ids, drafter, drafter_params, ignore_eos=args.ignore_eos,
                              **sampling, **mesh)
    first = True
    for update in updates:
        new = update.new_ids[0]
        if detok is not None:
            piece = detok.push(new) + (detok.flush() if update.result is not None else "")
        else:
            piece = ("" if first or not new else " ") + " ".join(map(str, new))
            first = first and not new
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    result = update.result
    s = result.stats
    log(
        f"{result.num_generated} tokens in {result.generate_s:.2f}s = {result.tokens_per_second:.1f} tok/s"
        f" (compile {result.compile_s:.1f}s); steps {s.steps}, tau {s.tau:.2f}, "
        f"accepted {s.accepted}/{s.drafted} drafts; {result.finish_reasons[0]}"
    )
    return None

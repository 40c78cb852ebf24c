"""Medusa head checkpoints: a directory with config.json + model.safetensors.

    drafter, params = load_medusa("runs/medusa/drafter")      # host numpy params
    save_medusa("out_dir", drafter.cfg, params)               # atomic (hf.write_checkpoint_dir)

config.json (`medusa_config_to_hf`): architectures ["SpecJaxMedusaHeads"], `medusa_num_heads`,
`medusa_num_layers` (residual blocks per head, the original Medusa configs' names), `hidden_size`,
`num_target_layers`, `vocab_size`, `rms_norm_eps`. Weights, HF layout ([out, in] matrices), named
as in the original Medusa heads plus each head's norm:
`medusa_head.{i}.norm.weight`, `medusa_head.{i}.{j}.linear.weight`, `medusa_head.{i}.{j}.linear.bias`.
The heads share the target's LM head, so there is no `medusa_head.{i}.{R}.weight`. Weights stored as
int8 with scales (`spec_jax.checkpoints.quantized`) load like float ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from spec_jax.checkpoints.errors import CheckpointError
from spec_jax.checkpoints.hf import named_hf_tensors, read_config_json, read_named_tensors, save_dir, write_checkpoint_dir
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, medusa_weight_specs
from spec_jax.models.weights import check_params_match_specs

__all__ = ["load_medusa", "save_medusa", "read_medusa_config", "is_medusa_checkpoint",
           "medusa_config_from_hf", "medusa_config_to_hf"]

ARCHITECTURE = "SpecJaxMedusaHeads"


def medusa_config_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> MedusaConfig:
    """From a spec_jax Medusa config.json (`medusa_config_to_hf`); the head counts use the names
    of the original Medusa configs (medusa_num_heads, medusa_num_layers)."""
    return MedusaConfig(
        num_heads=int(hf["medusa_num_heads"]),
        hidden_size=int(hf["hidden_size"]),
        num_target_layers=int(hf["num_target_layers"]),
        num_res_blocks=int(hf.get("medusa_num_layers", 1)),
        vocab_size=None if hf.get("vocab_size") is None else int(hf["vocab_size"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        dtype=dtype,
    )


def medusa_config_to_hf(cfg: MedusaConfig) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "medusa",
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_res_blocks,
        "hidden_size": cfg.hidden_size,
        "num_target_layers": cfg.num_target_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "torch_dtype": cfg.dtype,
    }


def _names(cfg: MedusaConfig):
    """(our params path (head, block or None, key), HF name, HF shape, in_axes) of every weight."""
    specs = medusa_weight_specs(cfg)
    for i, head in enumerate(specs["heads"]):
        yield (i, None, "norm"), f"medusa_head.{i}.norm.weight", head["norm"].shape, 0
        for j, block in enumerate(head["blocks"]):
            yield (i, j, "w"), f"medusa_head.{i}.{j}.linear.weight", block["w"].shape, 1
            yield (i, j, "b"), f"medusa_head.{i}.{j}.linear.bias", block["b"].shape, 0


def is_medusa_checkpoint(hf: Mapping[str, Any]) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or ()) or "medusa_num_heads" in hf


def read_medusa_config(directory: str | os.PathLike, dtype: str = "float32") -> MedusaConfig:
    """The MedusaConfig of a checkpoint dir, with a clear error for a missing or malformed config."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise CheckpointError(
            f"Medusa checkpoint {str(directory)!r} is not a directory; pass the dir holding config.json "
            "and model.safetensors (e.g. runs/medusa/drafter from `spec-jax train medusa`)."
        )
    config_file = directory / "config.json"
    hf = read_config_json(directory, "a Medusa checkpoint dir needs config.json next to its model.safetensors "
                          "(written by `spec-jax train medusa` / save_medusa).", "fix or re-export it")
    if not isinstance(hf, dict) or not is_medusa_checkpoint(hf):
        raise CheckpointError(
            f"{config_file} is not a Medusa heads config (architectures [{ARCHITECTURE!r}], "
            "medusa_num_heads); pass a dir written by `spec-jax train medusa`."
        )
    try:
        return medusa_config_from_hf(hf, dtype=dtype)
    except KeyError as e:
        raise CheckpointError(f"{config_file} lacks the field {e}; not a complete Medusa config.") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_file}: {e}") from e


def load_medusa(
    path: str | os.PathLike, dtype: str = "float32", k: int | None = None
) -> tuple[MedusaDrafter, dict[str, Any]]:
    """(drafter, host numpy params) from a Medusa checkpoint dir; every tensor name and shape is
    checked against config.json before any tensor is read."""
    directory = Path(path).expanduser()
    cfg = read_medusa_config(directory, dtype)
    source = f"{directory} (Medusa heads)"
    names = list(_names(cfg))
    values = read_named_tensors(directory, [entry[1:] for entry in names], source, dtype)
    heads: list[dict[str, Any]] = [{"blocks": [{} for _ in range(cfg.num_res_blocks)]}
                                   for _ in range(cfg.num_heads)]
    for ((i, j, key), *_), value in zip(names, values):
        if j is None:
            heads[i][key] = value
        else:
            heads[i]["blocks"][j][key] = value
    params = {"heads": heads}
    check_params_match_specs(params, medusa_weight_specs(cfg), what=source)
    return MedusaDrafter(cfg, k=k), params


def save_medusa(
    path: str | os.PathLike, cfg: MedusaConfig, params: Mapping[str, Any], overwrite: bool = False
) -> Path:
    """Write config.json + model.safetensors atomically (see hf.write_checkpoint_dir)."""
    path = save_dir(path, params, medusa_weight_specs(cfg), "Medusa params", overwrite)
    heads = params["heads"]
    tensors = named_hf_tensors(
        (name, np.asarray(heads[i][key] if j is None else heads[i]["blocks"][j][key], np.float32), in_axes)
        for (i, j, key), name, _, in_axes in _names(cfg)
    )
    return write_checkpoint_dir(path, medusa_config_to_hf(cfg), tensors)

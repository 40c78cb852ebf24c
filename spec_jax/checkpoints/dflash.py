"""DFlash drafter checkpoints in the z-lab HF format (config.json + model.safetensors).

    drafter, params = load_dflash("path/to/dflash_dir")   # or a hub id
    check_compatible(drafter.cfg, target.cfg)
    save_dflash("out_dir", drafter.cfg, params)           # the reference `dflash` package loads it

Weight names: `layers.{i}.<decoder-layer weight>` (mapped by the shared table in `hf.py`),
`fc.weight`, `hidden_norm.weight`, `norm.weight`. Seen variants are accepted on load: a `model.`
prefix, `midlayer.` for `layers.0.`, `encoder.fc.` for `fc.`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from spec_jax.checkpoints.errors import CheckpointError
from spec_jax.checkpoints.hf import (
    HFWeight,
    SafetensorsFiles,
    check_hf_tensors,
    expected_hf_layer_shapes,
    from_hf,
    hf_shape,
    refuse_to_clobber,
    resolve_hf_dir,
    layers_from_hf,
    to_hf,
    layers_to_hf,
    write_checkpoint_dir,
)
from spec_jax.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    check_compatible,
    dflash_weight_specs,
)
from spec_jax.models.weights import check_params_match_specs

__all__ = ["check_compatible", "load_dflash", "save_dflash", "canonical_weight_name"]

LAYER_PREFIX = "layers.{i}."

# The drafter's own (non-layer) weights; decoder-layer weights use hf.LAYER_WEIGHTS.
DFLASH_WEIGHTS: tuple[HFWeight, ...] = (
    HFWeight("fc", "fc.weight", 1),  # [H, n*H] -> [n*H, H]
    HFWeight("hidden_norm", "hidden_norm.weight", 0),
    HFWeight("norm", "norm.weight", 0),
)

# Variant prefix -> canonical prefix, applied after stripping a leading "model.".
_NAME_VARIANTS = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."))


def canonical_weight_name(name: str) -> str:
    """A checkpoint tensor name in the canonical z-lab spelling."""
    if name.startswith("model."):
        name = name[len("model.") :]
    for variant, canonical in _NAME_VARIANTS:
        if name.startswith(variant):
            return canonical + name[len(variant) :]
    return name


def expected_dflash_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    specs = dflash_weight_specs(cfg)
    out = expected_hf_layer_shapes(specs["layers"], LAYER_PREFIX)
    for w in DFLASH_WEIGHTS:
        out[w.hf_name] = hf_shape(specs[w.name].shape, w.in_axes)
    return out


def read_dflash_config(directory: Path, dtype: str = "float32") -> DFlashConfig:
    config_file = directory / "config.json"
    if not config_file.exists():
        raise CheckpointError(
            f"{directory} has no config.json; a DFlash checkpoint dir needs config.json next to "
            "model.safetensors."
        )
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); fix or re-download it.") from e
    try:
        return DFlashConfig.from_hf_config(hf, dtype=dtype)
    except KeyError as e:
        raise CheckpointError(
            f"{config_file} lacks the field {e}; it is not a complete DFlash drafter config."
        ) from e
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from e


def load_dflash(
    path_or_hub_id: str | os.PathLike, dtype: str = "float32", k: int | None = None
) -> tuple[DFlashDrafter, dict[str, Any]]:
    """(drafter, host numpy params) from a z-lab DFlash checkpoint dir or hub id.

    Every tensor name and shape is checked against config.json before any tensor is read.
    """
    import jax.numpy as jnp

    directory = resolve_hf_dir(path_or_hub_id)
    cfg = read_dflash_config(directory, dtype)
    np_dtype = jnp.dtype(dtype)
    with SafetensorsFiles(directory) as files:
        original_of: dict[str, str] = {}
        for name in files.shapes:
            canonical = canonical_weight_name(name)
            if canonical in original_of:
                raise CheckpointError(
                    f"DFlash checkpoint {directory} holds both {original_of[canonical]!r} and "
                    f"{name!r}, two spellings of the weight {canonical!r}; keep one."
                )
            original_of[canonical] = name
        available = {c: files.shapes[n] for c, n in original_of.items()}
        check_hf_tensors(
            available,
            expected_dflash_shapes(cfg),
            f"{directory} (DFlash drafter)",
            ignore=["rotary_emb.inv_freq"],
        )

        def get_tensor(canonical: str) -> np.ndarray:
            return files.get_tensor(original_of[canonical], np_dtype)

        specs = dflash_weight_specs(cfg)
        params: dict[str, Any] = {"layers": layers_from_hf(get_tensor, LAYER_PREFIX, specs["layers"])}
        for w in DFLASH_WEIGHTS:
            params[w.name] = from_hf(get_tensor(w.hf_name), specs[w.name].shape, w.in_axes)
    check_params_match_specs(params, specs, what=f"DFlash checkpoint {directory}")
    return DFlashDrafter(cfg, k=k), params


def dflash_params_to_hf(cfg: DFlashConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    check_params_match_specs(params, dflash_weight_specs(cfg), what="DFlash params")
    out = layers_to_hf(params["layers"], LAYER_PREFIX)
    for w in DFLASH_WEIGHTS:
        out[w.hf_name] = np.ascontiguousarray(to_hf(np.asarray(params[w.name]), w.in_axes))
    return out


def save_dflash(
    path: str | os.PathLike, cfg: DFlashConfig, params: Mapping[str, Any], overwrite: bool = False
) -> Path:
    """Write config.json + model.safetensors in the z-lab format.

    Written to a temporary sibling dir and renamed into place, so `path` never holds half a
    checkpoint; an existing non-empty `path` is replaced only with overwrite=True.
    """
    path = Path(path).expanduser().absolute()
    refuse_to_clobber(path, overwrite)
    tensors = dflash_params_to_hf(cfg, params)  # checks params against cfg before writing
    return write_checkpoint_dir(path, cfg.to_hf_config(), tensors)

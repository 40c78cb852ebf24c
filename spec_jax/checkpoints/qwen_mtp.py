"""The MTP head inside a Qwen3.5 / Qwen3-Next checkpoint (`mtp.*`), read and written.

    drafter, params = load_qwen_mtp("Qwen3.5-27B")          # the target's own directory
    write_qwen_mtp("my-qwen3.5", drafter.cfg, params)         # adds mtp.* next to the decoder

The head lives in the target's safetensors under `mtp.` (HF layout, [out, in]), as vLLM's
`qwen3_next_mtp` / `qwen3_5_mtp` read it: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.norm` (each `.weight` [H]) and `mtp.layers.0.*` with the target's
decoder-layer names (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, the two layer norms, and
`mlp.*` dense or with experts). The embedding and LM head are the target's. Its config is the
target's config.json (`mtp_num_hidden_layers`, when present, must be 1; the layer count is read
from the tensors). transformers' `save_pretrained` drops the head: a directory saved by it has
none, which is a clear error here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from spec_jax.checkpoints.errors import CheckpointError
from spec_jax.checkpoints.hf import (
    SafetensorsFiles,
    check_hf_tensors,
    expected_hf_layer_shapes,
    from_hf,
    hf_shape,
    layers_from_hf,
    layers_to_hf,
    read_hf_config,
    resolve_hf_dir,
    to_hf,
)
from spec_jax.checkpoints.hf_names import layer_table
from spec_jax.drafters.qwen_mtp import QwenMtpConfig, QwenMtpDrafter, mtp_weight_specs
from spec_jax.models.weights import check_params_match_specs

__all__ = ["load_qwen_mtp", "write_qwen_mtp", "save_qwen_mtp_head", "is_qwen_mtp_family"]

PREFIX = "mtp."
LAYER_PREFIX = "layers.{i}."  # under PREFIX
_TOP_NAMES = {  # our key -> (HF name under PREFIX, in_axes)
    "fc": ("fc.weight", 1), "pre_fc_norm_embedding": ("pre_fc_norm_embedding.weight", 0),
    "pre_fc_norm_hidden": ("pre_fc_norm_hidden.weight", 0), "norm": ("norm.weight", 0),
}
_FAMILIES = ("qwen3_5", "qwen3_next")


def is_qwen_mtp_family(hf: dict[str, Any]) -> bool:
    """A Qwen3.5 / Qwen3-Next (or Qwen3.5-MoE, multimodal included) config.json: its MTP head, if
    it has one, is in the same directory."""
    types = {hf.get("model_type"), (hf.get("text_config") or {}).get("model_type")}
    archs = " ".join(hf.get("architectures") or [])
    return any(str(t).startswith(f) for t in types if t for f in _FAMILIES) or bool(
        re.search(r"Qwen3_5|Qwen3Next", archs))


def _expected_shapes(cfg: QwenMtpConfig) -> dict[str, tuple[int, ...]]:
    specs = mtp_weight_specs(cfg)
    out = expected_hf_layer_shapes(specs["layers"], LAYER_PREFIX, layer_table(cfg.layer.architecture))
    out.update({hf_name: hf_shape(specs[key].shape, axes) for key, (hf_name, axes) in _TOP_NAMES.items()})
    return out


def head_dir_of_target(target: Any) -> Path | None:
    """The target's own directory when it is a local Qwen3.5 / Qwen3-Next checkpoint (`--drafter
    mtp` with no path: the head is in the same safetensors; `load_qwen_mtp` says so clearly when
    it is not there), else None."""
    directory = Path(str(getattr(target, "source", ""))).expanduser()
    try:
        hf = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return directory if isinstance(hf, dict) and is_qwen_mtp_family(hf) else None


def load_qwen_mtp(path: str | os.PathLike, dtype: str = "float32", k: int | None = None) -> tuple[QwenMtpDrafter, dict]:
    """(drafter, host numpy params) from a Qwen3.5 / Qwen3-Next checkpoint directory (or hub id)."""
    directory = resolve_hf_dir(path)
    hf, target_cfg = read_hf_config(directory, dtype)
    text = hf.get("text_config") or hf
    if int(text.get("mtp_num_hidden_layers", 1) or 1) != 1:
        raise CheckpointError(f"{directory}: mtp_num_hidden_layers = {text['mtp_num_hidden_layers']}; spec_jax "
                              "runs one-layer MTP heads (those Qwen3.5 / Qwen3-Next ship).")
    with SafetensorsFiles(directory) as files:
        names = {n[len(PREFIX):]: shape for n, shape in files.shapes.items() if n.startswith(PREFIX)}
        if not names:
            raise CheckpointError(
                f"{directory}: this checkpoint has no MTP head (no mtp.* tensors). Use the checkpoint as "
                "published (transformers' save_pretrained drops the head), or pick another drafter "
                "(e.g. --drafter ngram or dflash=PATH).")
        layers = {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}
        cfg = QwenMtpConfig.from_target(target_cfg, num_layers=max(len(layers), 1))
        check_hf_tensors(names, _expected_shapes(cfg), f"{directory} (its MTP head, mtp.*)")
        specs = mtp_weight_specs(cfg)
        np_dtype = jnp.dtype(dtype)

        def read(name: str) -> np.ndarray:
            return files.get_tensor(PREFIX + name, np_dtype)

        params: dict[str, Any] = {
            "layers": layers_from_hf(read, LAYER_PREFIX, specs["layers"], layer_table(cfg.layer.architecture))}
        for key, (hf_name, axes) in _TOP_NAMES.items():
            params[key] = from_hf(read(hf_name), specs[key].shape, axes)
    check_params_match_specs(params, specs)
    return QwenMtpDrafter(cfg, k=k), params


def mtp_tensors(cfg: QwenMtpConfig, params: Any) -> dict[str, np.ndarray]:
    """The head's tensors by their checkpoint names (`mtp.*`, HF layout), params checked first."""
    check_params_match_specs(params, mtp_weight_specs(cfg), what="params")
    tensors = {PREFIX + n: t for n, t in layers_to_hf(params["layers"], LAYER_PREFIX,
                                                      layer_table(cfg.layer.architecture)).items()}
    for key, (hf_name, axes) in _TOP_NAMES.items():
        tensors[PREFIX + hf_name] = np.ascontiguousarray(to_hf(np.asarray(params[key]), axes))
    return tensors


def save_qwen_mtp_head(path: str | os.PathLike, target_config: dict[str, Any], cfg: QwenMtpConfig, params: Any,
                       overwrite: bool = False) -> Path:
    """A directory holding the head alone, atomically: the target's config.json (`target_config`)
    and the `mtp.*` tensors (what `spec-jax train mtp` exports; `--drafter mtp=PATH` and
    `load_qwen_mtp` read it as they read the target's own checkpoint, which is not copied)."""
    from spec_jax.checkpoints.hf import refuse_to_clobber, write_checkpoint_dir

    path = Path(path).expanduser().absolute()
    refuse_to_clobber(path, overwrite)
    return write_checkpoint_dir(path, target_config, mtp_tensors(cfg, params))


def write_qwen_mtp(path: str | os.PathLike, cfg: QwenMtpConfig, params: Any) -> Path:
    """Add the head's `mtp.*` tensors to the checkpoint in `path` (a target saved by
    `save_pretrained` or spec_jax): a file of their own, `mtp.safetensors`, listed in the
    safetensors index (written when the directory has a single `model.safetensors`)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    directory = Path(path)
    tensors = mtp_tensors(cfg, params)
    save_file(tensors, str(directory / "mtp.safetensors"), metadata={"format": "pt"})
    index_file = directory / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
    else:
        with safe_open(str(directory / "model.safetensors"), framework="numpy") as f:
            index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in f.keys()}}
    index["weight_map"].update({n: "mtp.safetensors" for n in tensors})
    index_file.write_text(json.dumps(index, indent=2))
    return directory

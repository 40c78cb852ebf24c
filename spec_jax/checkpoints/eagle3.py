"""EAGLE-3 drafter checkpoints: the `speculators` format (what vLLM serves) and the original
EAGLE-3 layout of published heads.

    drafter, params = load_eagle3("path/or/hub-id", target_cfg=target.cfg)  # either layout
    save_eagle3("out_dir", drafter.cfg, params)                             # speculators format
    save_eagle3("out_dir", drafter.cfg, params, layout="eagle3")            # original layout

speculators: config.json with `speculators_model_type: "eagle3"`, the draft layers' HF config in
`transformer_layer_config`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, the norm
flags and `speculators_config` (proposal length, verifier); weights `layers.{i}.*` (the first
layer with `hidden_norm` and 2H-wide q/k/v), `fc.weight`, `norm.weight`, `lm_head.weight`,
`embed_tokens.weight`, `d2t` / `t2d`, optional `input_norm.weight` / `fc_norm.{i}.weight`.
Original layout: a Llama config.json at the top level (`draft_vocab_size`, vocab_size = the
target's) and the one layer named `midlayer.*`. Safetensors only (re-save `pytorch_model.bin`
heads with safetensors).

d2t holds offsets: target id = draft id + d2t[draft id]; t2d marks the target ids in the draft
vocabulary. Both are checked for consistency on load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

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
    read_config_json,
    read_vocab_map,
    refuse_to_clobber,
    resolve_hf_dir,
    to_hf,
    vocab_map_tensors,
    write_checkpoint_dir,
)
from spec_jax.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    default_aux_layer_ids,
    eagle3_weight_specs,
)
from spec_jax.models.config import ModelConfig
from spec_jax.models.weights import check_params_match_specs

__all__ = ["load_eagle3", "save_eagle3", "is_eagle3_checkpoint"]

LAYER_PREFIX = "layers.{i}."
LAYOUTS = ("speculators", "eagle3")

# Non-layer float weights: our params key, HF name, in_axes (see hf.HFWeight).
_TOP_WEIGHTS = (("fc", "fc.weight", 1), ("norm", "norm.weight", 0), ("lm_head", "lm_head.weight", 1),
                ("input_norm", "input_norm.weight", 0), ("embed", "embed_tokens.weight", 0))
_ORIGINAL_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def _canonical(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _read_config(directory: Path) -> dict[str, Any]:
    return read_config_json(directory, "an EAGLE-3 checkpoint dir needs config.json next to its safetensors weights.")


def is_eagle3_checkpoint(hf: Mapping[str, Any]) -> bool:
    return hf.get("speculators_model_type") == "eagle3" or any(
        a in _ORIGINAL_ARCHITECTURES for a in hf.get("architectures") or ()
    )


def _aux_ids(found: Any, target_cfg: ModelConfig | None, source: str) -> tuple[int, ...]:
    if found:
        return tuple(int(i) for i in found)
    if target_cfg is None:
        raise CheckpointError(
            f"{source} does not name its target feature layers (eagle_aux_hidden_state_layer_ids); "
            "load it together with its target so that EAGLE-3's default (2, L/2, L-3) applies, or "
            "add the field to config.json."
        )
    return default_aux_layer_ids(target_cfg.num_layers)


def config_from_hf(
    hf: Mapping[str, Any], *, dtype: str, own_embedding: bool, target_cfg: ModelConfig | None,
    source: str,
) -> Eagle3Config:
    """Eagle3Config from a speculators or an original-layout config.json."""
    try:
        if hf.get("speculators_model_type") not in (None, "eagle3"):
            raise CheckpointError(
                f"{source} is a speculators {hf['speculators_model_type']!r} checkpoint, not EAGLE-3; "
                "load it with the drafter kind it names."
            )
        speculators = hf.get("speculators_model_type") == "eagle3"
        layer_hf = dict(hf["transformer_layer_config"]) if speculators else dict(hf)
        layer_hf.setdefault("model_type", "llama")
        if not speculators:  # the head's own architecture name is EAGLE's; its layer is model_type's
            layer_hf["architectures"] = [
                "Qwen3ForCausalLM" if layer_hf["model_type"] == "qwen3" else "LlamaForCausalLM"
            ]
        # Special token ids of the draft layers' config mean nothing to a drafter.
        layer = ModelConfig.from_hf_config(layer_hf, dtype=dtype).replace(bos_token_id=None, eos_token_ids=())
        proposal = ((hf.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
        return Eagle3Config(
            layer=layer,
            draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
            aux_layer_ids=_aux_ids(hf.get("eagle_aux_hidden_state_layer_ids"), target_cfg, source),
            target_hidden_size=hf.get("target_hidden_size"),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            norm_before_fc=bool(hf.get("norm_before_fc", False)),
            fc_norm=bool(hf.get("fc_norm", False)),
            norm_output=bool(hf.get("norm_output", False)),
            own_embedding=own_embedding,
            speculative_tokens=int(proposal.get("speculative_tokens") or 3),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: config.json lacks the field {e}; not a complete EAGLE-3 config.") from e
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {e}") from e


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    specs = eagle3_weight_specs(cfg)
    out = expected_hf_layer_shapes(specs["layers"], LAYER_PREFIX)
    for key, name, in_axes in _TOP_WEIGHTS:
        if key in specs:
            out[name] = hf_shape(specs[key].shape, in_axes)
    for i, spec in enumerate(specs.get("fc_norms", ())):
        out[f"fc_norm.{i}.weight"] = spec.shape
    out["d2t"] = (cfg.draft_vocab_size,)
    out["t2d"] = (cfg.layer.vocab_size,)
    return out


def load_eagle3(
    path_or_hub_id: str | os.PathLike,
    dtype: str = "float32",
    k: int | None = None,
    target_cfg: ModelConfig | None = None,
) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """(drafter, host numpy params) from an EAGLE-3 checkpoint in either layout; every tensor name
    and shape is checked against config.json before any tensor is read. `target_cfg` supplies
    the default feature layers for checkpoints that name none."""
    directory = resolve_hf_dir(path_or_hub_id)
    source = f"{directory} (EAGLE-3 drafter)"
    hf = _read_config(directory)
    if not is_eagle3_checkpoint(hf):
        raise CheckpointError(
            f"{directory}/config.json is neither a speculators EAGLE-3 config "
            "(speculators_model_type 'eagle3') nor an original EAGLE-3 head "
            f"(architectures {list(_ORIGINAL_ARCHITECTURES)}); pass an EAGLE-3 checkpoint."
        )
    with SafetensorsFiles(directory) as files:
        original_of = files.canonical_names(_canonical, source)
        available = {c: files.shapes[n] for c, n in original_of.items()}
        cfg = config_from_hf(hf, dtype=dtype, own_embedding="embed_tokens.weight" in available,
                             target_cfg=target_cfg, source=source)
        expected = expected_shapes(cfg)
        if cfg.draft_vocab_size == cfg.layer.vocab_size:  # the identity map may be left out
            for name in ("d2t", "t2d"):
                if name not in available:
                    expected.pop(name)
        check_hf_tensors(available, expected, source,
                         ignore=["verifier_lm_head.weight", "verifier_norm.weight"])

        def get(name: str, as_dtype: Any = dtype) -> np.ndarray:
            return files.get_tensor(original_of[name], as_dtype)

        specs = eagle3_weight_specs(cfg)
        params: dict[str, Any] = {"layers": layers_from_hf(get, LAYER_PREFIX, specs["layers"])}
        for key, name, in_axes in _TOP_WEIGHTS:
            if key in specs:
                params[key] = from_hf(get(name), specs[key].shape, in_axes)
        if "fc_norms" in specs:
            params["fc_norms"] = [get(f"fc_norm.{i}.weight") for i in range(len(specs["fc_norms"]))]
        params["d2t"] = read_vocab_map(get, available, cfg.draft_vocab_size, cfg.layer.vocab_size, source)
    check_params_match_specs(params, specs, what=source)
    return Eagle3Drafter(cfg, k=k), params


def params_to_hf(cfg: Eagle3Config, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    specs = eagle3_weight_specs(cfg)
    check_params_match_specs(params, specs, what="EAGLE-3 params")
    out = layers_to_hf(params["layers"], LAYER_PREFIX)
    for key, name, in_axes in _TOP_WEIGHTS:
        if key in specs:
            out[name] = np.ascontiguousarray(to_hf(np.asarray(params[key]), in_axes))
    for i, w in enumerate(params.get("fc_norms", ())):
        out[f"fc_norm.{i}.weight"] = np.asarray(w)
    out.update(vocab_map_tensors(params["d2t"], cfg.layer.vocab_size))
    return out


def config_to_hf(cfg: Eagle3Config, layout: str, verifier: str | None = None) -> dict[str, Any]:
    layer_hf = cfg.layer.to_hf_config()
    flags = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
    }
    if layout == "eagle3":
        return {**layer_hf, "architectures": [_ORIGINAL_ARCHITECTURES[0]], **flags}
    return {  # as speculators' save_pretrained writes it
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_hf,
        **flags,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "tie_word_embeddings": False,
        "dtype": cfg.dtype,
    }


def save_eagle3(
    path: str | os.PathLike,
    cfg: Eagle3Config,
    params: Mapping[str, Any],
    layout: str = "speculators",
    overwrite: bool = False,
    verifier: str | None = None,
) -> Path:
    """Write config.json + model.safetensors in the speculators format (default) or the original
    EAGLE-3 layout (`midlayer.*`, one layer only), atomically (see hf.write_checkpoint_dir)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown EAGLE-3 layout {layout!r}; use one of {LAYOUTS}.")
    if layout == "eagle3" and cfg.layer.num_layers != 1:
        raise ValueError(
            f"the original EAGLE-3 layout holds one layer (midlayer); this drafter has "
            f"{cfg.layer.num_layers}. Save it in the speculators format."
        )
    path = Path(path).expanduser().absolute()
    refuse_to_clobber(path, overwrite)
    tensors = params_to_hf(cfg, params)
    if layout == "eagle3":
        tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t
                   for n, t in tensors.items()}
    return write_checkpoint_dir(path, config_to_hf(cfg, layout, verifier), tensors)

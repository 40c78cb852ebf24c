"""Gemma 4 assistant checkpoints: the HF format (`Gemma4AssistantForCausalLM`).

    drafter, params = load_gemma4_assistant("gemma-4-e2b-it-assistant")   # host numpy params
    save_gemma4_assistant("out_dir", drafter.cfg, params)                  # loads in transformers

config.json: `model_type` "gemma4_assistant", `backbone_hidden_size`, `use_ordered_embeddings`,
`num_centroids`, `centroid_intermediate_top_k`, and a Gemma 4 `text_config` (its layers all read
the target's keys/values, so they have no k/v projections). Weights (HF layout, [out, in]):
`model.layers.{i}.self_attn.{q_proj,q_norm,o_proj}`, the layer's four norms, its MLP and
`layer_scalar`, `model.norm`, `model.embed_tokens` (the tied head), `pre_projection`,
`post_projection`, and with ordered embeddings `masked_embedding.centroids.weight` and the int
`masked_embedding.token_ordering`. The default K comes from generation_config.json's
`num_assistant_tokens` when the directory has one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from spec_jax.checkpoints.errors import CheckpointError
from spec_jax.checkpoints.hf import named_hf_tensors, read_named_tensors, save_dir, write_checkpoint_dir
from spec_jax.drafters.gemma4_assistant import (
    Gemma4AssistantConfig,
    Gemma4AssistantDrafter,
    assistant_weight_specs,
)
from spec_jax.models.config import FULL_ATTENTION, SLIDING_ATTENTION
from spec_jax.models.weights import check_params_match_specs

__all__ = ["load_gemma4_assistant", "save_gemma4_assistant", "assistant_config_from_hf",
           "assistant_config_to_hf", "is_gemma4_assistant"]

ARCHITECTURE = "Gemma4AssistantForCausalLM"
_LAYER_NAMES = {  # our layer key -> (HF name under model.layers.{i}., in_axes)
    "attn_norm": ("input_layernorm.weight", 0), "post_attn_norm": ("post_attention_layernorm.weight", 0),
    "mlp_norm": ("pre_feedforward_layernorm.weight", 0), "post_mlp_norm": ("post_feedforward_layernorm.weight", 0),
    "wq": ("self_attn.q_proj.weight", 1), "q_norm": ("self_attn.q_norm.weight", 0),
    "wo": ("self_attn.o_proj.weight", 2), "w_gate": ("mlp.gate_proj.weight", 1),
    "w_up": ("mlp.up_proj.weight", 1), "w_down": ("mlp.down_proj.weight", 1),
    "layer_scalar": ("layer_scalar", 0),
}
_TOP_NAMES = {  # our key -> (HF name, in_axes)
    "pre_projection": ("pre_projection.weight", 1), "post_projection": ("post_projection.weight", 1),
    "embed": ("model.embed_tokens.weight", 0), "final_norm": ("model.norm.weight", 0),
    "lm_head": ("lm_head.weight", 1), "centroids": ("masked_embedding.centroids.weight", 1),
    "token_ordering": ("masked_embedding.token_ordering", 0),
}


def is_gemma4_assistant(hf: Mapping[str, Any]) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or ()) or hf.get("model_type") == "gemma4_assistant"


def assistant_config_from_hf(hf: Mapping[str, Any], dtype: str = "float32", k: int | None = None) -> Gemma4AssistantConfig:
    """From an HF `Gemma4AssistantConfig` dict; refuses what the assistant format rules out."""
    text = dict(hf.get("text_config") or {})
    for name, off in (("hidden_size_per_layer_input", 0), ("vocab_size_per_layer_input", 0),
                      ("enable_moe_block", False), ("use_double_wide_mlp", False)):
        if text.get(name, off) not in (off, None):
            raise ValueError(f"text_config.{name} is {text[name]!r}; a Gemma 4 assistant has {off!r} there.")
    if text.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"text_config.hidden_activation {text['hidden_activation']!r} is not supported "
                         "(Gemma 4 uses gelu_pytorch_tanh).")
    layers = int(text["num_hidden_layers"])
    layer_types = tuple(text.get("layer_types") or (SLIDING_ATTENTION,) * (layers - 1) + (FULL_ATTENTION,))
    rope = text.get("rope_parameters") or {}
    sliding_rope = rope.get(SLIDING_ATTENTION) or {"rope_type": "default", "rope_theta": 10_000.0}
    full_rope = rope.get(FULL_ATTENTION) or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                             "rope_theta": 1_000_000.0}
    if sliding_rope.get("rope_type", "default") != "default" or full_rope.get("rope_type") not in ("default", "proportional"):
        raise ValueError(f"rope_parameters {rope!r}: the assistant supports default RoPE on sliding layers "
                         "and default or proportional RoPE on full ones (Gemma 4's).")
    if full_rope.get("factor", 1.0) != 1.0:
        raise ValueError("a proportional RoPE factor other than 1 is not supported for the assistant.")
    head_dim, kv_heads = int(text.get("head_dim", 256)), int(text.get("num_key_value_heads", 4))
    global_head_dim, global_kv_heads = _full_layer_shapes(text, layer_types, head_dim, kv_heads)
    return Gemma4AssistantConfig(
        vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]), num_heads=int(text["num_attention_heads"]),
        layer_types=layer_types, head_dim=head_dim, num_kv_heads=kv_heads,
        backbone_hidden_size=int(hf.get("backbone_hidden_size", 1536)),
        global_head_dim=global_head_dim, num_global_kv_heads=global_kv_heads,
        sliding_window=text.get("sliding_window", 512),
        sliding_rope_theta=float(sliding_rope.get("rope_theta", 10_000.0)),
        full_rope_theta=float(full_rope.get("rope_theta", 1_000_000.0)),
        full_partial_rotary_factor=float(full_rope.get("partial_rotary_factor", 1.0)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        use_ordered_embeddings=bool(hf.get("use_ordered_embeddings", False)),
        num_centroids=int(hf.get("num_centroids", 2048)),
        centroid_top_k=int(hf.get("centroid_intermediate_top_k", 32)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        num_assistant_tokens=int(k or 4), dtype=dtype,
    )


def _full_layer_shapes(text: Mapping[str, Any], layer_types, head_dim: int, kv_heads: int) -> tuple[int, int]:
    """(head size, KV heads) of the full-attention layers: transformers writes them per layer
    (`per_layer_config`), the original configs as `global_head_dim` / `num_global_key_value_heads`
    (the latter only with `attention_k_eq_v`)."""
    per_layer = text.get("per_layer_config") or {}
    full = [i for i, t in enumerate(layer_types) if t == FULL_ATTENTION]
    if per_layer:
        shapes = {(int(o.get("head_dim", head_dim)), int(o.get("num_key_value_heads", kv_heads)))
                  for i, o in per_layer.items() if int(i) in full}
        shapes |= {(head_dim, kv_heads) for i in full if str(i) not in per_layer and i not in per_layer}
        if len(shapes) > 1:
            raise ValueError(f"per_layer_config gives the full-attention layers different shapes {sorted(shapes)}.")
        return shapes.pop() if shapes else (head_dim, kv_heads)
    global_kv = text.get("num_global_key_value_heads") if text.get("attention_k_eq_v", False) else None
    return int(text.get("global_head_dim") or 512), int(global_kv or kv_heads)


def assistant_config_to_hf(cfg: Gemma4AssistantConfig) -> dict[str, Any]:
    """The config.json transformers' `Gemma4AssistantForCausalLM.from_pretrained` reads back."""
    text = {
        "model_type": "gemma4_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "global_head_dim": cfg.global_head_dim or cfg.head_dim,
        "attention_k_eq_v": cfg.num_global_kv_heads is not None,
        "num_global_key_value_heads": cfg.num_global_kv_heads,
        "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window or 512,
        "num_kv_shared_layers": cfg.num_layers, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": cfg.sliding_rope_theta},
            FULL_ATTENTION: {"rope_type": "proportional", "rope_theta": cfg.full_rope_theta,
                             "partial_rotary_factor": cfg.full_partial_rotary_factor},
        },
    }
    return {
        "architectures": [ARCHITECTURE], "model_type": "gemma4_assistant", "text_config": text,
        "backbone_hidden_size": cfg.backbone_hidden_size, "use_ordered_embeddings": cfg.use_ordered_embeddings,
        "num_centroids": cfg.num_centroids or 2048, "centroid_intermediate_top_k": cfg.centroid_top_k or 32,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.dtype,
    }


def _names(cfg: Gemma4AssistantConfig):
    """(params path (layer index or None, key), HF name, our shape, in_axes) of every weight."""
    specs = assistant_weight_specs(cfg)
    for key, spec in specs.items():
        if key != "layers":
            name, in_axes = _TOP_NAMES[key]
            yield (None, key), name, spec.shape, in_axes
    for i, layer in enumerate(specs["layers"]):
        for key, spec in layer.items():
            name, in_axes = _LAYER_NAMES[key]
            yield (i, key), f"model.layers.{i}.{name}", spec.shape, in_axes


def _read_json(file: Path, what: str) -> Any:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); fix or re-download the {what}.") from e


def load_gemma4_assistant(
    path: str | os.PathLike, dtype: str = "float32", k: int | None = None
) -> tuple[Gemma4AssistantDrafter, dict[str, Any]]:
    """(drafter, host numpy params) from an HF assistant dir; names and shapes are checked against
    config.json before any tensor is read."""
    directory = Path(path).expanduser()
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} holds no config.json; pass the directory of a Gemma 4 assistant "
                              "(e.g. a download of google/gemma-4-e2b-it-assistant).")
    hf = _read_json(config_file, "assistant checkpoint")
    if not isinstance(hf, dict) or not is_gemma4_assistant(hf):
        raise CheckpointError(f"{config_file} is not a Gemma 4 assistant config (architectures "
                              f"[{ARCHITECTURE!r}], model_type 'gemma4_assistant').")
    generation = directory / "generation_config.json"
    if k is None and generation.is_file():
        k = _read_json(generation, "assistant checkpoint").get("num_assistant_tokens")
    try:
        cfg = assistant_config_from_hf(hf, dtype, k)
    except KeyError as e:
        raise CheckpointError(f"{config_file} lacks the field {e}; not a complete assistant config.") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_file}: {e}") from e
    source = f"{directory} (Gemma 4 assistant)"
    names = list(_names(cfg))
    # The tied head is model.embed_tokens; a separate lm_head.weight copy of it may be saved too.
    ignore = ["lm_head.weight"] if cfg.tie_embeddings else []
    integer = {name: np.int32 for (_, key), name, _, _ in names if key == "token_ordering"}
    values = read_named_tensors(directory, [entry[1:] for entry in names], source, dtype, ignore, integer)
    params: dict[str, Any] = {"layers": [{} for _ in range(cfg.num_layers)]}
    for ((layer, key), *_), value in zip(names, values):
        (params if layer is None else params["layers"][layer])[key] = value
    check_params_match_specs(params, assistant_weight_specs(cfg), what=source)
    return Gemma4AssistantDrafter(cfg), params


def save_gemma4_assistant(
    path: str | os.PathLike, cfg: Gemma4AssistantConfig, params: Mapping[str, Any], overwrite: bool = False
) -> Path:
    """config.json + model.safetensors (+ generation_config.json with the default K), atomically."""
    path = save_dir(path, params, assistant_weight_specs(cfg), "Gemma 4 assistant params", overwrite)
    tensors = named_hf_tensors(
        (name, np.asarray((params if layer is None else params["layers"][layer])[key],
                          np.int64 if key == "token_ordering" else np.float32), in_axes)
        for (layer, key), name, _, in_axes in _names(cfg)
    )
    return write_checkpoint_dir(path, assistant_config_to_hf(cfg), tensors,
                                json_files={"generation_config.json": {"num_assistant_tokens": cfg.num_assistant_tokens}})

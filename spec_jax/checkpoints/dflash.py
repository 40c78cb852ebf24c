"""DFlash drafter checkpoints in the z-lab HF format (config.json + model.safetensors), and in
the `speculators` format vLLM serves (`speculators_model_type: "dflash"`, read and written for
full-attention drafters, with the target's vocabulary or a reduced draft vocabulary; its aux
layer ids are z-lab's + 1).

    drafter, params = load_dflash("path/to/dflash_dir")   # or a hub id
    check_compatible(drafter.cfg, target.cfg)
    save_dflash("out_dir", drafter.cfg, params)           # the reference `dflash` package loads it
    save_dflash("out_dir", drafter.cfg, params, layout="speculators")  # speculators / vLLM load it

Weight names: `layers.{i}.<decoder-layer weight>` (mapped by the shared table in `hf.py`),
`fc.weight`, `hidden_norm.weight`, `norm.weight`. Seen variants are accepted on load: a `model.`
prefix, `midlayer.` for `layers.0.`, `encoder.fc.` for `fc.`. A reduced draft vocabulary adds
the drafter's own `lm_head.weight` [Vd, H] and the `d2t` / `t2d` maps (speculators format only).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from spec_jax.checkpoints.errors import CheckpointError
from spec_jax.checkpoints.hf_names import BIASED_DECODER_LAYER
from spec_jax.checkpoints.hf import (
    HFWeight,
    SafetensorsFiles,
    check_hf_tensors,
    expected_hf_layer_shapes,
    from_hf,
    hf_shape,
    read_config_json,
    read_vocab_map,
    refuse_to_clobber,
    resolve_hf_dir,
    layers_from_hf,
    to_hf,
    layers_to_hf,
    vocab_map_tensors,
    write_checkpoint_dir,
)
from spec_jax.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    check_compatible,
    default_target_layer_ids,
    dflash_layers,
    dflash_weight_specs,
)
from spec_jax.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    gpt_oss_defaults,
    layer_stack_to_hf,
    rope_from_hf,
)
from spec_jax.models.weights import check_params_match_specs

__all__ = ["check_compatible", "load_dflash", "save_dflash", "canonical_weight_name",
           "dflash_config_from_hf", "dflash_config_to_hf"]

LAYER_PREFIX = "layers.{i}."
# Decoder-layer names, attention biases included (`attention_bias`: z-lab's gpt-oss drafters).
DFLASH_LAYER = {w.name: w for w in BIASED_DECODER_LAYER}

# The drafter's own (non-layer) weights; decoder-layer weights use hf.LAYER_WEIGHTS.
DFLASH_WEIGHTS: tuple[HFWeight, ...] = (
    HFWeight("fc", "fc.weight", 1),  # [H, n*H] -> [n*H, H]
    HFWeight("hidden_norm", "hidden_norm.weight", 0),
    HFWeight("norm", "norm.weight", 0),
)
# The drafter's own head over a reduced draft vocabulary: [Vd, H] -> [H, Vd].
DRAFT_HEAD = HFWeight("lm_head", "lm_head.weight", 1)

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
    out = expected_hf_layer_shapes(specs["layers"], LAYER_PREFIX, DFLASH_LAYER)
    for w in DFLASH_WEIGHTS:
        out[w.hf_name] = hf_shape(specs[w.name].shape, w.in_axes)
    if cfg.draft_vocab_size:
        out[DRAFT_HEAD.hf_name] = hf_shape(specs["lm_head"].shape, DRAFT_HEAD.in_axes)
        out["d2t"] = (cfg.draft_vocab_size,)
        out["t2d"] = (cfg.vocab_size,)
    return out


def _from_speculators_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """A speculators DFlash config.json (what vLLM serves) as the z-lab fields it maps to.

    speculators names the target's features by HF hidden_states index (aux id i = output of
    layer i - 1), z-lab by layer (id i = output of layer i); its drafter may also carry a
    reduced draft vocabulary (kept as `draft_vocab_size`) or draft from the anchor slot, which
    spec_jax's DFlash does not."""
    problems = []
    layer = dict(hf.get("transformer_layer_config") or {})
    vocab = layer.get("vocab_size")
    draft_vocab = hf.get("draft_vocab_size")
    if hf.get("sample_from_anchor"):
        problems.append("sample_from_anchor (drafts from the anchor slot too)")
    if "sliding_attention" in (layer.get("layer_types") or ()):
        problems.append("sliding-window layers (speculators windows the context differently from z-lab)")
    aux = hf.get("aux_hidden_state_layer_ids")
    if not aux or min(aux) < 1:
        problems.append(f"aux_hidden_state_layer_ids {aux} (need ids >= 1: the embedding is not a feature)")
    if problems:
        raise CheckpointError(
            f"{source}: speculators DFlash with {'; '.join(problems)} is not supported by spec_jax's "
            "DFlash; convert a full-vocabulary, full-attention drafter."
        )
    return {
        **layer,
        "draft_vocab_size": None if draft_vocab in (None, vocab) else int(draft_vocab),
        "block_size": hf.get("block_size"),
        "dflash_config": {"mask_token_id": hf.get("mask_token_id"),
                          "target_layer_ids": [int(i) - 1 for i in aux]},
        **({"is_causal": False} if hf.get("sliding_window_non_causal") else {}),
    }


def dflash_config_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> DFlashConfig:
    """Parse a z-lab DFlash config.json (Qwen3 fields + block_size, num_target_layers,
    dflash_config.{mask_token_id, target_layer_ids}); DFlash values are looked up in
    `dflash_config` first, then at the top level, as the reference does."""
    if hf.get("model_type") == "gpt_oss":  # z-lab's gpt-oss drafters: read as transformers does
        hf = gpt_oss_defaults(hf)
    extra = hf.get("dflash_config") or {}

    def draft_value(name: str, default: Any = None) -> Any:
        value = extra.get(name, hf.get(name, default))
        return default if value is None else value

    def optional_float(name: str) -> float | None:
        value = draft_value(name)
        return None if value is None else float(value)

    num_layers = int(hf["num_hidden_layers"])
    num_target_layers = hf.get("num_target_layers")
    ids = draft_value("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ValueError(
                "DFlash config has neither dflash_config.target_layer_ids nor num_target_layers; "
                "add target_layer_ids (the target layers whose hidden states the drafter reads)."
            )
        ids = default_target_layer_ids(int(num_target_layers), num_layers)
    mask_token_id = draft_value("mask_token_id")
    if mask_token_id is None:
        raise ValueError(
            "DFlash config lacks dflash_config.mask_token_id (the token that fills the block); "
            "add it to config.json."
        )
    is_causal = draft_value("is_causal")
    return DFlashConfig(
        layer=_dflash_layers_from_hf(hf, num_layers, optional_float("final_logit_softcapping"), dtype),
        block_size=int(draft_value("block_size", 16)),
        target_layer_ids=tuple(int(i) for i in ids),
        mask_token_id=int(mask_token_id),
        is_causal=None if is_causal is None else bool(is_causal),
        input_embedding_scale=optional_float("input_embedding_scale"),
        output_multiplier=optional_float("output_multiplier"),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        draft_vocab_size=None if hf.get("draft_vocab_size") is None else int(hf["draft_vocab_size"]),
    )


def _dflash_layers_from_hf(
    hf: Mapping[str, Any], num_layers: int, softcap: float | None, dtype: str
) -> ModelConfig:
    """The draft layers' config; layer types follow the reference's rules: a sliding layer
    without a window is causal but unlimited."""
    layer_types = tuple(hf.get("layer_types") or ())
    # Qwen3Config keeps sliding_window only when use_sliding_window is set.
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if not layer_types and window and hf.get("use_sliding_window"):
        first_sliding = hf.get("max_window_layers", num_layers)
        layer_types = tuple(
            SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)
        )
    if SLIDING_ATTENTION not in layer_types and len(layer_types) == num_layers:
        layer_types = ()  # every layer full: the default
    num_heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    rope_theta, rope_scaling = rope_from_hf(hf)
    return dflash_layers(
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        intermediate_size=int(hf["intermediate_size"]),
        vocab_size=int(hf.get("vocab_size") or 0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
        final_logit_softcapping=softcap,
        dtype=dtype,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
    )


def dflash_config_to_hf(cfg: DFlashConfig) -> dict[str, Any]:
    """z-lab format config.json that the reference `dflash.DFlashDraftModel` loads."""
    layer = cfg.layer
    dflash_config: dict[str, Any] = {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
    }
    for name, value in (("input_embedding_scale", cfg.input_embedding_scale),
                        ("output_multiplier", cfg.output_multiplier),
                        ("final_logit_softcapping", layer.final_logit_softcapping)):
        if value is not None:
            dflash_config[name] = value
    hf: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **layer_stack_to_hf(layer),
        "attention_bias": layer.qkv_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": SLIDING_ATTENTION in cfg.layer_types and layer.sliding_window is not None,
        "sliding_window": layer.sliding_window,
        "max_window_layers": layer.num_layers,
        "block_size": cfg.block_size,
        "dflash_config": dflash_config,
    }
    if cfg.num_target_layers is not None:
        hf["num_target_layers"] = cfg.num_target_layers
    if cfg.vocab_size is not None:
        hf["vocab_size"] = cfg.vocab_size
    if cfg.is_causal is not None:
        hf["is_causal"] = cfg.is_causal
    return hf


def read_dflash_config(directory: Path, dtype: str = "float32") -> DFlashConfig:
    config_file = directory / "config.json"
    hf = read_config_json(directory, "a DFlash checkpoint dir needs config.json next to model.safetensors.")
    kind = hf.get("speculators_model_type")
    if kind is not None and kind != "dflash":
        raise CheckpointError(
            f"{config_file} is a speculators {kind!r} checkpoint, not DFlash; pass it as "
            f"--drafter {kind}=PATH."
        )
    if kind == "dflash":
        hf = _from_speculators_config(hf, str(config_file))
    try:
        return dflash_config_from_hf(hf, dtype=dtype)
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
        original_of = files.canonical_names(canonical_weight_name, f"DFlash checkpoint {directory}")
        available = {c: files.shapes[n] for c, n in original_of.items()}
        own_head = ["lm_head.weight", "d2t", "t2d"] if cfg.draft_vocab_size else []
        check_hf_tensors(
            available,
            expected_dflash_shapes(cfg),
            f"{directory} (DFlash drafter)",
            # speculators also keeps the target's embedding / head and an identity vocab map.
            ignore=[n for n in ("rotary_emb.inv_freq", "embed_tokens.weight", "lm_head.weight", "d2t",
                                "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
                    if n not in own_head],
        )

        def get_tensor(canonical: str) -> np.ndarray:
            return files.get_tensor(original_of[canonical], np_dtype)

        specs = dflash_weight_specs(cfg)
        params: dict[str, Any] = {"layers": layers_from_hf(get_tensor, LAYER_PREFIX, specs["layers"], DFLASH_LAYER)}
        for w in DFLASH_WEIGHTS:
            params[w.name] = from_hf(get_tensor(w.hf_name), specs[w.name].shape, w.in_axes)
        if cfg.draft_vocab_size:
            w = DRAFT_HEAD
            params[w.name] = from_hf(get_tensor(w.hf_name), specs[w.name].shape, w.in_axes)
            # d2t and t2d are both there (check_hf_tensors requires them with a draft vocabulary).
            params["d2t"] = read_vocab_map(lambda name, as_dtype: files.get_tensor(original_of[name], as_dtype),
                                           original_of, cfg.draft_vocab_size, cfg.vocab_size,
                                           f"{directory} (DFlash drafter)")
    check_params_match_specs(params, specs, what=f"DFlash checkpoint {directory}")
    return DFlashDrafter(cfg, k=k), params


def dflash_params_to_hf(cfg: DFlashConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    check_params_match_specs(params, dflash_weight_specs(cfg), what="DFlash params")
    out = layers_to_hf(params["layers"], LAYER_PREFIX, DFLASH_LAYER)
    for w in DFLASH_WEIGHTS + ((DRAFT_HEAD,) if cfg.draft_vocab_size else ()):
        out[w.hf_name] = np.ascontiguousarray(to_hf(np.asarray(params[w.name]), w.in_axes))
    if cfg.draft_vocab_size:
        out.update(vocab_map_tensors(params["d2t"], cfg.vocab_size))
    return out


def speculators_config(cfg: DFlashConfig, verifier: str | None = None) -> dict[str, Any]:
    """The speculators (vLLM) config.json of a DFlash drafter (full or reduced draft vocabulary)."""
    zlab = dflash_config_to_hf(cfg)
    layer = {k: v for k, v in zlab.items()
             if k not in ("architectures", "block_size", "dflash_config", "is_causal")}
    if SLIDING_ATTENTION in cfg.layer_types or cfg.is_causal or cfg.input_embedding_scale is not None \
            or cfg.output_multiplier is not None or cfg.layer.final_logit_softcapping is not None:
        raise ValueError(
            "this DFlash drafter uses z-lab options the speculators format cannot express (sliding "
            "layers, is_causal, input_embedding_scale, output_multiplier or final_logit_softcapping); "
            "save it in the z-lab format."
        )
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": cfg.is_causal is False,
        "sample_from_anchor": False,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "dtype": cfg.dtype,
    }


def save_dflash(
    path: str | os.PathLike,
    cfg: DFlashConfig,
    params: Mapping[str, Any],
    overwrite: bool = False,
    layout: str = "z-lab",
) -> Path:
    """Write config.json + model.safetensors in the z-lab format (default) or the speculators
    format vLLM serves (`layout="speculators"`; full-attention layers; the only layout for a
    reduced draft vocabulary).

    Written to a temporary sibling dir and renamed into place, so `path` never holds half a
    checkpoint; an existing non-empty `path` is replaced only with overwrite=True.
    """
    if layout not in ("z-lab", "speculators"):
        raise ValueError(f"unknown DFlash layout {layout!r}; use 'z-lab' or 'speculators'.")
    if layout == "speculators" and cfg.vocab_size is None:
        raise ValueError("the speculators format needs the drafter's vocab_size; set it in its config.")
    if layout == "z-lab" and cfg.draft_vocab_size:
        raise ValueError(
            "the z-lab DFlash format has no reduced draft vocabulary (z-lab drafts through the "
            "target's LM head); save this drafter with layout='speculators'."
        )
    path = Path(path).expanduser().absolute()
    refuse_to_clobber(path, overwrite)
    config = dflash_config_to_hf(cfg) if layout == "z-lab" else speculators_config(cfg)
    tensors = dflash_params_to_hf(cfg, params)  # checks params against cfg before writing
    return write_checkpoint_dir(path, config, tensors)

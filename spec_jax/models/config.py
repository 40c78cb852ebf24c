"""Frozen decoder configs that map to and from HF `config.json`.

Every family is a config of the same decoder; each difference from Llama is a static switch that
defaults off (so a Llama config compiles to the same computation as before the switch existed):
  Llama, Mistral  pre-norm, SwiGLU, RoPE; Mistral: a sliding window on every layer
  Qwen2 / 2.5     + q/k/v biases; sliding layers from `use_sliding_window` / `max_window_layers`
  Qwen3           + per-head q/k RMSNorm, explicit head_dim, optional sliding layers
  Gemma 3 text    + (1 + w) RMSNorms, four per layer ("sandwich"), GeGLU (tanh GELU), embeddings
                  times sqrt(hidden) in the model dtype, query_pre_attn_scalar, q/k norms, a
                  sliding/full `layer_types` pattern with each type's own RoPE base and scaling
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    # The multimodal checkpoint: its language model (config.text_config) is a Gemma 3 text decoder.
    "Gemma3ForConditionalGeneration": "gemma3",
}
# model_type -> family, for configs without `architectures`.
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                "gemma3_text": "gemma3", "gemma3": "gemma3"}
# What each family writes back to config.json.
_HF_NAMES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
             "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
             "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}

# Gemma3TextConfig's defaults: hub configs (notably the `text_config` of the multimodal
# checkpoints) leave out every field equal to them.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "hidden_activation": "gelu_pytorch_tanh",
}

GLOBAL_WINDOW = 1 << 30  # "no sliding window": larger than any cache capacity
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """KV-cache bytes one token takes: a key and a value per KV head in every layer."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_ITEMSIZE)}.")
    return 2 * num_layers * num_kv_heads * head_dim * _ITEMSIZE[dtype]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x `rope_type: llama3` frequency scaling (the only scaling the supported models use)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """`rope_type: linear` (position interpolation): every frequency divided by `factor` (Gemma 3
    4B+ global layers)."""

    factor: float


AnyRopeScaling = RopeScaling | LinearRopeScaling


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyperparameters of one decoder. Hashable, so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: AnyRopeScaling | None = None
    tie_embeddings: bool = False
    qk_norm: bool = False
    # Per-layer "full_attention" / "sliding_attention" (HF `layer_types`); () = every layer full.
    # A sliding layer attends to the last `sliding_window` tokens (no limit when it is None).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    max_position_embeddings: int = 8192
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    # ---- family switches (all off for Llama) ----
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry biases
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (norm_offset + w), computed in float32
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP as well
    mlp_activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # RoPE of the sliding-window layers when it differs from the full layers' (Gemma 3: local
    # base 10k, no scaling); None: every layer uses rope_theta / rope_scaling.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: AnyRopeScaling | None = None

    def __post_init__(self):
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but the model has "
                f"{self.num_layers} layers; give one type per layer (or none: every layer full)."
            )
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(
                f"layer types {unknown} are not supported; use '{FULL_ATTENTION}' or '{SLIDING_ATTENTION}'."
            )
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ValueError(
                f"mlp_activation {self.mlp_activation!r} is not supported; use 'silu' or 'gelu_tanh'."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups."
            )

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer attention window in tokens (GLOBAL_WINDOW = unlimited)."""
        window = self.sliding_window or GLOBAL_WINDOW
        types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        return tuple(window if t == SLIDING_ATTENTION else GLOBAL_WINDOW for t in types)

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def plain_decoder(self) -> "ModelConfig":
        """These shapes as a plain decoder (Llama, or Qwen3 when it has q/k norms): every family
        switch off. A drafter that copies a target's config for its own layers (EAGLE-3) runs the
        plain layer math, so this is the config that describes it."""
        return self.replace(
            architecture="qwen3" if self.qk_norm else "llama", qkv_bias=False, norm_offset=0.0,
            sandwich_norms=False, mlp_activation="silu", scale_embeddings=False,
            query_pre_attn_scalar=None, final_logit_softcapping=None, sliding_rope_theta=None,
            sliding_rope_scaling=None,
        )

    def layer_rope(self, layer: int) -> tuple[float, AnyRopeScaling | None]:
        """(RoPE base, scaling) of decoder layer `layer`."""
        if self.sliding_rope_theta is not None and self.layer_windows[layer] != GLOBAL_WINDOW:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    # ---------------------------------------------------------------- HF mapping
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], dtype: str = "float32") -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = None
        for name in archs:
            arch = SUPPORTED_ARCHITECTURES.get(name, arch)
        if arch is None:
            arch = _MODEL_TYPES.get(model_type)
        if arch is None:
            raise ValueError(
                f"Unsupported architecture {archs or model_type!r}: spec_jax supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(sorted(_MODEL_TYPES))}). "
                "Convert the model or pick a supported target."
            )
        if arch == "gemma3":
            return _gemma3_from_hf(cls, hf, dtype)
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        num_layers = hf["num_hidden_layers"]
        rope_theta, rope_scaling = rope_from_hf(hf)
        if arch == "mistral":
            # MistralConfig ignores layer_types: a sliding_window applies to every layer.
            window = hf.get("sliding_window")
            layer_types, window = ((SLIDING_ATTENTION,) * num_layers, int(window)) if window else ((), None)
        else:
            layer_types, window = layer_types_from_hf(hf, num_layers, arch)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            layer_types=layer_types,
            sliding_window=window,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
            dtype=dtype,
            qkv_bias=arch == "qwen2",
        )

    def to_hf_config(self) -> dict[str, Any]:
        arch_name, model_type = _HF_NAMES[self.architecture]
        hf: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": self.dtype,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = rope_scaling_to_hf(self.rope_scaling)
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        sliding = [w for w in self.layer_windows if w != GLOBAL_WINDOW]
        if self.architecture == "gemma3":
            return _gemma3_to_hf(self, hf)
        if self.architecture == "mistral":
            hf["sliding_window"] = sliding[0] if sliding else None
        elif sliding:
            hf["sliding_window"] = sliding[0]
            hf["use_sliding_window"] = True
            hf["layer_types"] = [
                "full_attention" if w == GLOBAL_WINDOW else "sliding_attention"
                for w in self.layer_windows
            ]
            # Qwen2 reads max_window_layers when its file has no layer_types; both agree here.
            first_sliding = self.layer_windows.index(sliding[0])
            hf["max_window_layers"] = (
                first_sliding if all(w != GLOBAL_WINDOW for w in self.layer_windows[first_sliding:])
                else self.num_layers
            )
        return hf


def config_fields(cfg: Any) -> dict[str, Any]:
    """A config dataclass's fields by name, an embedded `ModelConfig` (a drafter's `layer`)
    spread in: what two drafter configs can be compared by, field by field."""
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        fields.update(config_fields(value) if isinstance(value, ModelConfig) else {field.name: value})
    return fields


def _eos_ids(eos: Any) -> tuple[int, ...]:
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return tuple(int(e) for e in eos_ids)


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, AnyRopeScaling | None]:
    """(RoPE base, scaling) of a config with one RoPE for every layer."""
    # transformers >= 5 writes `rope_parameters` (theta included); older files `rope_scaling`.
    rs = hf.get("rope_parameters") or hf.get("rope_scaling") or None
    return float((rs or {}).get("rope_theta", hf.get("rope_theta", 10000.0))), rope_scaling_from_hf(rs)


def rope_scaling_from_hf(rs: Mapping[str, Any] | None) -> AnyRopeScaling | None:
    """A `rope_scaling` / `rope_parameters` object -> RopeScaling, LinearRopeScaling or None."""
    if not rs:
        return None
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type == "llama3":
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    if rope_type == "linear":
        return LinearRopeScaling(factor=float(rs["factor"]))
    if rope_type not in (None, "default"):
        raise ValueError(
            f"Unsupported rope_scaling type {rope_type!r}; spec_jax implements 'llama3' and 'linear'."
        )
    return None


def rope_scaling_to_hf(scaling: AnyRopeScaling) -> dict[str, Any]:
    if isinstance(scaling, LinearRopeScaling):
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}


def _gemma3_from_hf(cls, hf: Mapping[str, Any], dtype: str) -> ModelConfig:
    """Gemma 3 text: a Gemma3ForCausalLM config, or the `text_config` of a
    Gemma3ForConditionalGeneration one; absent fields take Gemma3TextConfig's defaults."""
    outer: Mapping[str, Any] = {}
    if "text_config" in hf or hf.get("model_type") == "gemma3":
        # The multimodal file may keep the token ids outside its text_config.
        outer = {k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None}
        hf = hf.get("text_config") or {}
    hf = {**GEMMA3_TEXT_DEFAULTS, **outer, **{k: v for k, v in hf.items() if v is not None or k not in outer}}
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(
            "attn_logit_softcapping is set: spec_jax's attention has no score soft-capping (Gemma 2 "
            "style); Gemma 3 checkpoints leave it null. Set it to null only if the model was trained so."
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder config) is not a causal LM target.")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"hidden_activation {hf['hidden_activation']!r}: spec_jax's Gemma MLP is tanh-approximated GELU."
        )
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    layer_types, window = layer_types_from_hf(
        {"layer_types": layer_types, "sliding_window": hf.get("sliding_window")}, num_layers, "gemma3"
    )
    # Per-type RoPE: transformers >= 5 nests it by layer type in rope_parameters; older files have
    # rope_theta + rope_scaling (global) and rope_local_base_freq (sliding).
    rp = hf.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        full = rp.get("full_attention") or {}
        local = rp.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", hf["rope_theta"]))
        scaling = rope_scaling_from_hf(full)
        local_theta = float(local.get("rope_theta", hf["rope_local_base_freq"]))
        local_scaling = rope_scaling_from_hf(local)
    else:
        theta = float(rp.get("rope_theta", hf["rope_theta"]))
        scaling = rope_scaling_from_hf(hf.get("rope_scaling") or (rp or None))
        local_theta = float(hf["rope_local_base_freq"])
        local_scaling = None
    return cls(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=int(hf["num_key_value_heads"]),
        head_dim=int(hf["head_dim"]),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        qk_norm=True,
        layer_types=layer_types,
        sliding_window=window,
        max_position_embeddings=int(hf["max_position_embeddings"]),
        architecture="gemma3",
        bos_token_id=hf["bos_token_id"],
        eos_token_ids=_eos_ids(hf["eos_token_id"]),
        dtype=dtype,
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        scale_embeddings=True,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        final_logit_softcapping=(None if hf.get("final_logit_softcapping") is None
                                 else float(hf["final_logit_softcapping"])),
        sliding_rope_theta=local_theta,
        sliding_rope_scaling=local_scaling,
    )


def _gemma3_to_hf(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    sliding = [w for w in cfg.layer_windows if w != GLOBAL_WINDOW]
    hf.pop("rope_theta")
    hf.pop("rope_scaling", None)
    hf.pop("hidden_act")
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        full.update(rope_scaling_to_hf(cfg.rope_scaling))
    local = {"rope_type": "default",
             "rope_theta": cfg.sliding_rope_theta if cfg.sliding_rope_theta is not None else cfg.rope_theta}
    local_scaling = cfg.sliding_rope_scaling if cfg.sliding_rope_theta is not None else cfg.rope_scaling
    if local_scaling is not None:
        local.update(rope_scaling_to_hf(local_scaling))
    hf.update(
        hidden_activation="gelu_pytorch_tanh",
        # Gemma3TextConfig validates it as an int.
        query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
        final_logit_softcapping=cfg.final_logit_softcapping,
        attn_logit_softcapping=None,
        sliding_window=sliding[0] if sliding else GEMMA3_TEXT_DEFAULTS["sliding_window"],
        layer_types=["full_attention" if w == GLOBAL_WINDOW else "sliding_attention" for w in cfg.layer_windows],
        rope_parameters={"full_attention": full, "sliding_attention": local},
    )
    return hf


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def layer_types_from_hf(
    hf: Mapping[str, Any], num_layers: int, arch: str = "qwen3"
) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) of a target from HF `layer_types` / `sliding_window` fields;
    ((), None) when every layer is full."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if arch == "qwen2" and not hf.get("use_sliding_window"):
        # Qwen2Config drops sliding_window unless use_sliding_window: every layer is full then.
        layer_types = [FULL_ATTENTION] * num_layers
    if layer_types is None:
        # Qwen2/Qwen3 without layer_types: sliding layers only when use_sliding_window is set, for
        # the layers at or past max_window_layers (as transformers derives layer_types).
        if hf.get("use_sliding_window") and window:
            mwl = hf.get("max_window_layers", num_layers)
            layer_types = [SLIDING_ATTENTION if i >= mwl else FULL_ATTENTION for i in range(num_layers)]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config layer_types has {len(layer_types)} entries for {num_layers} layers; fix config.json."
        )
    for kind in layer_types:
        if kind == SLIDING_ATTENTION and not window:
            raise ValueError("layer_types names a sliding_attention layer but sliding_window is unset.")
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ValueError(
                f"layer type {kind!r} is not supported (only full_attention and sliding_attention)."
            )
    if SLIDING_ATTENTION not in layer_types:
        return (), None
    return tuple(layer_types), int(window)

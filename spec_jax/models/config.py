"""Frozen decoder configs that map to and from HF `config.json`.

Every family is a config of the same decoder; each difference from Llama is a static switch that
defaults off (so a Llama config compiles to the same computation as before the switch existed):
  Llama, Mistral  pre-norm, SwiGLU, RoPE; Mistral: a sliding window on every layer
  Qwen2 / 2.5     + q/k/v biases; sliding layers from `use_sliding_window` / `max_window_layers`
  Qwen3           + per-head q/k RMSNorm, explicit head_dim, optional sliding layers
  Gemma 3 text    + (1 + w) RMSNorms, four per layer ("sandwich"), GeGLU (tanh GELU), embeddings
                  times sqrt(hidden) in the model dtype, query_pre_attn_scalar, q/k norms, a
                  sliding/full `layer_types` pattern with each type's own RoPE base and scaling
  Gemma 4 text    + the full-attention layers' own head size / KV heads (values = keys' projection
                  with `attention_k_eq_v`), proportional (partial) RoPE there, unscaled v-norm,
                  attention scale 1, per-layer embeddings (PLE), a learned scalar per layer, the
                  last `num_kv_shared_layers` layers reading an earlier layer's keys/values (no
                  cache of their own; a double-wide MLP there), plain (w, not 1 + w) norm scales
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Mixture-of-experts families (spec_jax.models.moe): a dense family's attention + MoE layers.
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3",
    # The multimodal checkpoint: its language model (config.text_config) is a Gemma 3 text decoder.
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    # Its text decoder (config.text_config); the vision and audio towers are not run.
    "Gemma4ForConditionalGeneration": "gemma4",
    # Hybrid Gated DeltaNet + gated attention; the multimodal Qwen3.5 checkpoints' text decoder.
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "GptOssForCausalLM": "gpt_oss",
}
# model_type -> family, for configs without `architectures`.
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral",
                "gemma3_text": "gemma3", "gemma3": "gemma3", "gemma4_text": "gemma4", "gemma4": "gemma4",
                "qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5", "qwen3_next": "qwen3_next",
                "qwen3_5_moe_text": "qwen3_5", "qwen3_5_moe": "qwen3_5",
                "gpt_oss": "gpt_oss"}
# What each family writes back to config.json.
_HF_NAMES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
             "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
             "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
             "mixtral": ("MixtralForCausalLM", "mixtral"),
             "gemma3": ("Gemma3ForCausalLM", "gemma3_text"), "gemma4": ("Gemma4ForCausalLM", "gemma4_text"),
             "gpt_oss": ("GptOssForCausalLM", "gpt_oss")}

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
LINEAR_ATTENTION = "linear_attention"  # a Gated DeltaNet layer (Qwen3.5 / Qwen3-Next)

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """KV-cache bytes one token takes: a key and a value per KV head in every layer."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_ITEMSIZE)}.")
    return 2 * num_layers * num_kv_heads * head_dim * _ITEMSIZE[dtype]


# The experts' gated activations `spec_jax.models.moe.expert_activation` implements.
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu", "gelu_tanh")
# How the router turns logits into top-k weights (see MoeConfig.router_scoring).
ROUTER_SCORINGS = ("softmax", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts feed-forward block (`spec_jax.models.moe`): every layer not in
    `dense_layers` runs `num_experts` SwiGLU experts of width `expert_intermediate_size`, each
    token through its router's `top_k`.

    normalize_top_k:  the top-k weights renormalised to sum 1 (Mixtral; Qwen-MoE's norm_topk_prob)
    dense_layers:     layers with the dense MLP of width `intermediate_size` instead (Qwen-MoE's
                      mlp_only_layers and decoder_sparse_step)
    shared_expert_intermediate_size: a dense expert every token runs as well (0: none);
    shared_expert_gate:  scaled by sigmoid(x @ w) (Qwen2-MoE, Qwen3-Next)
    router_scoring:   "softmax": a softmax over every expert, then the top k; "topk_softmax": the
                      top k logits, then a softmax over them (gpt-oss)
    router_bias, expert_bias: the router and the experts' projections carry biases (gpt-oss)
    expert_activation: the experts' gated activation (one of EXPERT_ACTIVATIONS); gpt-oss's
                      "clamped_swiglu" is (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
                      with g = min(gate, limit), `swiglu_alpha` and `swiglu_limit`; Gemma 4's
                      "gelu_tanh" is gelu_tanh(gate) * up
    router_input_norm: the router reads RMSNorm(x) (no weight) times a learned scale [H] and
                      hidden_size ** -0.5, and each chosen expert's weight is then multiplied by
                      a learned per-expert scale [E] (Gemma 4)
    beside_dense_mlp: the layer keeps its dense MLP and runs the experts next to it: the router and
                      the experts read the residual stream (the experts through a norm of their
                      own), each branch's output has its own norm, and their sum goes on through
                      the layer's post-MLP norm (Gemma 4; `decoder.feed_forward`)
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool = False
    dense_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_scoring: str = "softmax"
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_input_norm: bool = False
    beside_dense_mlp: bool = False

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoE top_k={self.top_k} must be between 1 and num_experts={self.num_experts}; "
                "fix num_experts_per_tok in config.json."
            )
        if self.expert_intermediate_size < 1:
            raise ValueError(f"MoE expert_intermediate_size={self.expert_intermediate_size} must be positive.")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router_scoring {self.router_scoring!r} is not one of {ROUTER_SCORINGS}.")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert_activation {self.expert_activation!r} is not one of {EXPERT_ACTIVATIONS}.")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(int(i) for i in self.dense_layers))))

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


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


@dataclasses.dataclass(frozen=True)
class ProportionalRope:
    """`rope_type: proportional` (Gemma 4's full-attention layers): only the first
    `partial_rotary_factor` of each head's dimensions rotate, at the frequencies the whole head
    size would give them; the rest keep frequency 0 (no rotation). Frequencies divided by `factor`."""

    partial_rotary_factor: float
    factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """`rope_type: yarn` (gpt-oss; transformers' `_compute_yarn_parameters`): frequencies blended
    between the original (extrapolation, high frequencies) and divided by `factor`
    (interpolation, low frequencies) by a linear ramp over the dimensions between the
    `beta_fast` and `beta_slow` rotation counts (floored / ceiled when `truncate`); cos and sin are
    multiplied by `attention_factor` (resolved from `mscale` / `mscale_all_dim` / `factor` when
    the config does not set it)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


AnyRopeScaling = RopeScaling | LinearRopeScaling | ProportionalRope | YarnRopeScaling


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
    # Mixture-of-experts layers in place of the dense MLP (spec_jax.models.moe); None: dense.
    moe: MoeConfig | None = None
    # ---- Gemma 4 switches (all off for the other families) ----
    global_head_dim: int | None = None  # head size of the full-attention layers (None: head_dim)
    num_global_kv_heads: int | None = None  # their KV heads (None: num_kv_heads)
    attention_k_eq_v: bool = False  # full-attention layers: values = the key projection (no wv)
    # The last N layers attend to the keys/values of the last earlier layer of their type and
    # keep no cache of their own (the cache has num_layers - N layer arrays).
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False  # those shared layers' MLPs are 2 * intermediate_size wide
    value_norm: bool = False  # values RMS-normed (no learned scale) before attention
    layer_scalar: bool = False  # each layer's output times a learned scalar
    # Per-layer embeddings (PLE): a second table [per_layer_vocab_size, num_layers * this] whose
    # slice i, mixed with a projection of the input embeddings, gates a residual branch of layer
    # i; 0 = off.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0

    # ---- gpt-oss switches (all off for the other families) ----
    o_bias: bool = False  # the attention output projection carries a bias
    attention_sinks: bool = False  # a learned logit per query head joins each softmax's denominator

    # ---- hybrid recurrent switches (Qwen3.5 / Qwen3-Next; all off for the other families) ----
    # Gated DeltaNet sizes of the layers typed "linear_attention" (HF `linear_*`; 0: none).
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    attn_output_gate: bool = False  # attention output times sigmoid(a gate half of q_proj)
    partial_rotary_factor: float = 1.0  # RoPE turns only the first this fraction of each head

    def __post_init__(self):
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but the model has "
                f"{self.num_layers} layers; give one type per layer (or none: every layer full)."
            )
        known = {FULL_ATTENTION, SLIDING_ATTENTION} | ({LINEAR_ATTENTION} if self.linear_num_value_heads else set())
        unknown = sorted(set(self.layer_types) - known)
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
        if self.num_global_kv_heads is not None and self.num_heads % self.num_global_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_global_kv_heads="
                f"{self.num_global_kv_heads}; grouped-query attention needs whole groups."
            )
        if self.num_kv_shared_layers:
            self._check_kv_sharing()
        self._check_yarn()

    def _check_yarn(self) -> None:
        if isinstance(self.sliding_rope_scaling, YarnRopeScaling) or (
            isinstance(self.rope_scaling, YarnRopeScaling) and self.sliding_rope_theta is not None
        ):
            raise ValueError(
                "YaRN RoPE is implemented for one RoPE shared by every layer (gpt-oss); this config "
                "gives its sliding layers their own RoPE. Use one rope_parameters for all layers."
            )

    def _check_kv_sharing(self) -> None:
        first_shared = self.num_layers - self.num_kv_shared_layers
        if not 0 < first_shared < self.num_layers:
            raise ValueError(
                f"num_kv_shared_layers={self.num_kv_shared_layers} must be between 0 and "
                f"num_layers - 1 = {self.num_layers - 1}: a shared layer reads an earlier layer's cache."
            )
        types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        missing = sorted(set(types[first_shared:]) - set(types[:first_shared]))
        if missing:
            raise ValueError(
                f"the KV-shared layers include {missing} layers but no earlier layer of that type "
                "keeps a cache to share; fix layer_types or num_kv_shared_layers."
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

    def is_full_attention(self, layer: int) -> bool:
        return not self.layer_types or self.layer_types[layer] == FULL_ATTENTION

    def layer_head_dim(self, layer: int) -> int:
        """Head size of decoder layer `layer` (Gemma 4: `global_head_dim` on full-attention layers)."""
        if self.global_head_dim is not None and self.is_full_attention(layer):
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        if self.num_global_kv_heads is not None and self.is_full_attention(layer):
            return self.num_global_kv_heads
        return self.num_kv_heads

    def layer_intermediate_size(self, layer: int) -> int:
        return self.intermediate_size * (2 if self.double_wide_mlp and self.kv_source(layer) != layer else 1)

    def kv_source(self, layer: int) -> int:
        """The layer whose keys/values layer `layer` attends to: itself, or for one of the last
        `num_kv_shared_layers` layers, the last earlier layer of the same type (as HF shares them)."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return layer
        types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        return max(i for i in range(first_shared) if types[i] == types[layer])

    @property
    def num_cache_layers(self) -> int:
        """Layers with KV-cache arrays of their own (the first num_layers - num_kv_shared_layers)."""
        return self.num_layers - self.num_kv_shared_layers

    @property
    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """(KV heads, head size) of each cache array, one per layer that has its own."""
        return tuple((self.layer_kv_heads(i), self.layer_head_dim(i)) for i in range(self.num_cache_layers)
                     if not self.is_linear_attention(i))

    def is_linear_attention(self, layer: int) -> bool:
        """A Gated DeltaNet layer (a recurrent state, no keys/values)."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(kv_bytes_per_token(1, kv, d, self.dtype) for kv, d in self.kv_cache_shapes)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def plain_decoder(self) -> "ModelConfig":
        """These shapes as a plain decoder (Llama, or Qwen3 when it has q/k norms): every family
        switch off. A drafter that copies a target's config for its own layers (EAGLE-3) runs the
        plain layer math, so this is the config that describes it."""
        return self.replace(
            architecture="qwen3" if self.qk_norm else "llama", qkv_bias=False, norm_offset=0.0, moe=None,
            sandwich_norms=False, mlp_activation="silu", scale_embeddings=False,
            query_pre_attn_scalar=None, final_logit_softcapping=None, sliding_rope_theta=None,
            sliding_rope_scaling=None, global_head_dim=None, num_global_kv_heads=None,
            attention_k_eq_v=False, num_kv_shared_layers=0, double_wide_mlp=False,
            value_norm=False, layer_scalar=False, per_layer_input_size=0, per_layer_vocab_size=0,
            o_bias=False, attention_sinks=False,
            linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
            attn_output_gate=False, partial_rotary_factor=1.0,
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
        if arch in ("qwen3_5", "qwen3_next"):
            return _qwen3_5_from_hf(cls, hf, arch, dtype)
        if arch == "gemma3":
            return _gemma3_from_hf(cls, hf, dtype)
        if arch in MOE_FAMILIES:
            return _moe_from_hf(cls, hf, dtype, arch)
        if arch == "gemma4":
            return _gemma4_from_hf(cls, hf, dtype)
        if arch == "gpt_oss":
            return _gpt_oss_from_hf(cls, hf, dtype)
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        num_layers = hf["num_hidden_layers"]
        rope_theta, rope_scaling = rope_from_hf(hf)
        if isinstance(rope_scaling, YarnRopeScaling):  # implemented and checked against HF for gpt-oss
            raise ValueError(
                f"Unsupported rope_scaling type 'yarn' for {arch}: spec_jax implements YaRN for gpt-oss "
                "only. Use the model's unscaled RoPE (drop rope_scaling) for contexts within its "
                "original length."
            )
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
        if self.moe is not None and self.architecture in MOE_FAMILIES:
            return _moe_to_hf(self)
        arch_name, model_type = _HF_NAMES[self.architecture]
        hf: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            **layer_stack_to_hf(self),
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
        }
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        sliding = [w for w in self.layer_windows if w != GLOBAL_WINDOW]
        if self.architecture == "gemma3":
            return _gemma3_to_hf(self, hf)
        if self.architecture == "gemma4":
            return _gemma4_to_hf(self, hf)
        if self.architecture == "gpt_oss":
            return _gpt_oss_to_hf(self, hf)
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


def layer_stack_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a stack of decoder layers (sizes, heads, norm, RoPE, dtype): a
    target's config and a DFlash drafter's (`checkpoints.dflash`) both start from these."""
    hf: dict[str, Any] = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": cfg.dtype,
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = rope_scaling_to_hf(cfg.rope_scaling)
    return hf


# MoE family -> the dense family whose attention and config fields it shares.
MOE_FAMILIES = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}


def _moe_from_hf(cls, hf: Mapping[str, Any], dtype: str, arch: str) -> ModelConfig:
    """Qwen3-MoE, Qwen2-MoE and Mixtral: the dense family's config (attention, RoPE, windows)
    plus the MoE block. Qwen-MoE layer i has experts unless i is in `mlp_only_layers` or
    (i + 1) % decoder_sparse_step != 0, as transformers builds them."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r}: spec_jax's {arch} experts are SwiGLU (silu).")
    num_layers = int(hf["num_hidden_layers"])
    dense_hf = {**hf, "architectures": [], "model_type": MOE_FAMILIES[arch]}
    if arch == "qwen3_moe":
        # Qwen3MoeConfig: one window on every layer when use_sliding_window, none otherwise.
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        dense_hf.update(layer_types=[SLIDING_ATTENTION if window else FULL_ATTENTION] * num_layers,
                        sliding_window=window)
    elif arch == "qwen2_moe" and hf.get("layer_types") is None:
        # Qwen2MoeConfig: with use_sliding_window, the odd-numbered layers below max_window_layers
        # (1st, 3rd, ...) slide.
        sliding = bool(hf.get("use_sliding_window"))
        mwl = hf.get("max_window_layers", 28)
        dense_hf["layer_types"] = [SLIDING_ATTENTION if sliding and (i + 1) % 2 and i < mwl else FULL_ATTENTION
                                   for i in range(num_layers)]
        dense_hf["use_sliding_window"] = True  # so the qwen2 path reads the layer_types above
    base = ModelConfig.from_hf_config(dense_hf, dtype)
    if arch == "qwen2_moe":
        base = base.replace(qkv_bias=bool(hf.get("qkv_bias", True)))
    if arch == "mixtral":
        experts, width = hf.get("num_local_experts", hf.get("num_experts", 8)), hf["intermediate_size"]
        dense_layers: list[int] = []
    else:
        experts, width = hf.get("num_experts", hf.get("num_local_experts")), hf["moe_intermediate_size"]
        step = int(hf.get("decoder_sparse_step", 1))
        only = set(int(i) for i in hf.get("mlp_only_layers") or ())
        if not only <= set(range(num_layers)):
            raise ValueError(f"mlp_only_layers {sorted(only)} names layers outside 0..{num_layers - 1}.")
        dense_layers = [i for i in range(num_layers) if i in only or (i + 1) % step]
    moe = MoeConfig(
        num_experts=int(experts), top_k=int(hf["num_experts_per_tok"]), expert_intermediate_size=int(width),
        normalize_top_k=arch == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        dense_layers=tuple(dense_layers),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0,
        shared_expert_gate=arch == "qwen2_moe",
    )
    return base.replace(architecture=arch, moe=moe)


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """`_moe_from_hf`'s inverse: the dense family's config.json plus the MoE fields."""
    moe, arch = cfg.moe, cfg.architecture
    if arch not in MOE_FAMILIES:
        raise ValueError(f"architecture {arch!r} has no MoE config.json mapping; use one of {sorted(MOE_FAMILIES)}.")
    hf = cfg.replace(architecture=MOE_FAMILIES[arch], moe=None).to_hf_config()
    hf["architectures"], hf["model_type"] = [_HF_NAMES[arch][0]], _HF_NAMES[arch][1]
    hf["num_experts_per_tok"] = moe.top_k
    windows = set(cfg.layer_windows)
    if arch == "mixtral":
        if moe.dense_layers or moe.shared_expert_intermediate_size or not moe.normalize_top_k:
            raise ValueError("Mixtral has experts on every layer, no shared expert and renormalised top-k weights.")
        hf.update(num_local_experts=moe.num_experts, intermediate_size=moe.expert_intermediate_size)
        return hf
    hf.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_intermediate_size,
              norm_topk_prob=moe.normalize_top_k, decoder_sparse_step=1, mlp_only_layers=list(moe.dense_layers))
    if arch == "qwen3_moe":
        if len(windows) > 1:
            raise ValueError("Qwen3-MoE slides every layer or none; this config mixes sliding and full layers.")
        window = windows.pop()
        for name in ("layer_types", "max_window_layers"):
            hf.pop(name, None)
        hf.update(use_sliding_window=window != GLOBAL_WINDOW, sliding_window=None if window == GLOBAL_WINDOW else window)
    else:  # qwen2_moe
        hf.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=moe.shared_expert_intermediate_size)
        if not moe.shared_expert_gate or not moe.shared_expert_intermediate_size:
            raise ValueError("Qwen2-MoE has a gated shared expert; this config has none.")
        hf.setdefault("layer_types", [FULL_ATTENTION if w == GLOBAL_WINDOW else SLIDING_ATTENTION
                                      for w in cfg.layer_windows])
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
    if rope_type == "proportional":
        return ProportionalRope(
            partial_rotary_factor=float(rs.get("partial_rotary_factor", 1.0)), factor=float(rs.get("factor", 1.0))
        )
    if rope_type == "yarn":
        return yarn_from_hf(rs)
    if rope_type not in (None, "default"):
        raise ValueError(
            f"Unsupported rope_scaling type {rope_type!r}; spec_jax implements 'llama3', 'linear', "
            "'proportional' and 'yarn'."
        )
    return None


def yarn_from_hf(rs: Mapping[str, Any]) -> YarnRopeScaling:
    """A `rope_type: yarn` object -> YarnRopeScaling, with transformers' defaults and its
    attention factor resolved (0.1 * mscale * ln(factor) + 1, a ratio of two such with
    `mscale` / `mscale_all_dim`)."""
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("YaRN with partial_rotary_factor != 1 is not implemented in spec_jax.")
    for name in ("factor", "original_max_position_embeddings"):
        if rs.get(name) is None:
            raise ValueError(f"rope_scaling type 'yarn' lacks {name!r}; add it to config.json.")
    factor = float(rs["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            attention_factor = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        beta_fast=float(rs.get("beta_fast") or 32.0),
        beta_slow=float(rs.get("beta_slow") or 1.0),
        truncate=bool(rs.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def rope_scaling_to_hf(scaling: AnyRopeScaling) -> dict[str, Any]:
    if isinstance(scaling, YarnRopeScaling):
        return {"rope_type": "yarn", **dataclasses.asdict(scaling)}
    if isinstance(scaling, LinearRopeScaling):
        return {"rope_type": "linear", "factor": scaling.factor}
    if isinstance(scaling, ProportionalRope):
        out = {"rope_type": "proportional", "partial_rotary_factor": scaling.partial_rotary_factor}
        return out if scaling.factor == 1.0 else {**out, "factor": scaling.factor}
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
        **_shape_fields(hf),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=True,
        layer_types=layer_types,
        sliding_window=window,
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


def _shape_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The sizes, norm epsilon, tying and context length of a config.json whose family's
    defaults are already filled in (Gemma 3, gpt-oss)."""
    return dict(
        vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=int(hf["num_attention_heads"]), num_kv_heads=int(hf["num_key_value_heads"]),
        head_dim=int(hf["head_dim"]), rms_norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]), max_position_embeddings=int(hf["max_position_embeddings"]),
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


# Gemma4TextConfig's defaults (transformers 5.24), for fields a hub config leaves out.
GEMMA4_TEXT_DEFAULTS = {
    "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "sliding_window": 512, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh",
    "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256, "global_head_dim": 512,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
}


def _gemma4_from_hf(cls, hf: Mapping[str, Any], dtype: str) -> ModelConfig:
    """Gemma 4 text: a Gemma4ForCausalLM config, or the `text_config` of a
    Gemma4ForConditionalGeneration one (dense variants and the MoE one, 26B-A4B)."""
    outer: Mapping[str, Any] = {}
    if "text_config" in hf or hf.get("model_type") == "gemma4":
        outer = {k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None}
        hf = hf.get("text_config") or {}
    hf = {**GEMMA4_TEXT_DEFAULTS, **outer, **{k: v for k, v in hf.items() if v is not None or k not in outer}}
    refused = {
        "use_bidirectional_attention": "bidirectional attention (an encoder config) is not a causal LM target",
        "attention_bias": "spec_jax's Gemma 4 layers have no attention biases",
    }
    for field, why in refused.items():
        if hf.get(field):
            raise ValueError(f"{field}={hf[field]!r}: {why}.")
    if hf["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"hidden_activation {hf['hidden_activation']!r}: spec_jax's Gemma MLP is tanh-approximated GELU."
        )
    num_layers = int(hf["num_hidden_layers"])
    layer_types = list(hf.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(num_layers)
    ])
    if layer_types:
        layer_types[-1] = FULL_ATTENTION  # as Gemma4TextConfig forces it
    layer_types, window = layer_types_from_hf(
        {"layer_types": layer_types, "sliding_window": hf.get("sliding_window")}, num_layers, "gemma4"
    )
    rp = hf.get("rope_parameters") or {}
    full, local = rp.get(FULL_ATTENTION) or {}, rp.get(SLIDING_ATTENTION) or {}
    for kind, params in ((FULL_ATTENTION, full), (SLIDING_ATTENTION, local)):
        if params.get("rope_type", "default") not in ("default", "proportional"):
            raise ValueError(
                f"rope_parameters.{kind}.rope_type {params['rope_type']!r}: spec_jax's Gemma 4 "
                "implements 'default' and 'proportional'."
            )
    global_head_dim, global_kv_heads = _gemma4_global_attention(hf, layer_types or (FULL_ATTENTION,) * num_layers)
    per_layer_input_size = int(hf.get("hidden_size_per_layer_input") or 0)
    return cls(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=int(hf["num_key_value_heads"]),
        head_dim=int(hf["head_dim"]),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_scaling=rope_scaling_from_hf(full),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        qk_norm=True,
        layer_types=layer_types,
        sliding_window=window,
        max_position_embeddings=int(hf["max_position_embeddings"]),
        architecture="gemma4",
        bos_token_id=hf["bos_token_id"],
        eos_token_ids=_eos_ids(hf["eos_token_id"]),
        dtype=dtype,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        scale_embeddings=True,
        query_pre_attn_scalar=1.0,  # Gemma 4 attention scores are q.k unscaled (q/k are normed)
        final_logit_softcapping=(None if hf.get("final_logit_softcapping") is None
                                 else float(hf["final_logit_softcapping"])),
        sliding_rope_theta=float(local.get("rope_theta", 10_000.0)),
        sliding_rope_scaling=rope_scaling_from_hf(local),
        global_head_dim=global_head_dim,
        num_global_kv_heads=global_kv_heads,
        attention_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
        num_kv_shared_layers=int(hf.get("num_kv_shared_layers") or 0),
        double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
        value_norm=True,
        layer_scalar=True,
        per_layer_input_size=per_layer_input_size,
        per_layer_vocab_size=int(hf["vocab_size_per_layer_input"]) if per_layer_input_size else 0,
        moe=_gemma4_moe_from_hf(hf),
    )


def _gemma4_moe_from_hf(hf: Mapping[str, Any]) -> MoeConfig | None:
    """Gemma 4's MoE block (26B-A4B, `enable_moe_block`): on every layer, `num_experts` GeGLU
    experts of width `moe_intermediate_size` beside the dense MLP, softmax router, top
    `top_k_experts` renormalised then scaled per expert (transformers' Gemma4TextRouter)."""
    if not hf.get("enable_moe_block"):
        return None
    missing = [f for f in ("num_experts", "top_k_experts", "moe_intermediate_size") if not hf.get(f)]
    if missing:
        raise ValueError(f"enable_moe_block=True needs {', '.join(missing)} in config.json (the MoE block's shape).")
    return gemma4_moe(int(hf["num_experts"]), int(hf["top_k_experts"]), int(hf["moe_intermediate_size"]))


def gemma4_moe(num_experts: int, top_k: int, expert_intermediate_size: int) -> MoeConfig:
    """Gemma 4's MoE block with its shape (the switches are the same in every Gemma 4 MoE model)."""
    return MoeConfig(num_experts, top_k, expert_intermediate_size, normalize_top_k=True,
                     expert_activation="gelu_tanh", router_input_norm=True, beside_dense_mlp=True)


def _gemma4_global_attention(hf: Mapping[str, Any], layer_types: Sequence[str]) -> tuple[int | None, int | None]:
    """(global_head_dim, num_global_kv_heads) of a Gemma 4 config: from `per_layer_config` (what
    transformers 5.24 writes: head_dim / num_key_value_heads overrides on the full-attention layers)
    or, without it, `global_head_dim` and (only with attention_k_eq_v, as transformers reads them)
    `num_global_key_value_heads`."""
    head_dim, kv_heads = int(hf["head_dim"]), int(hf["num_key_value_heads"])
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        global_kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        return int(hf["global_head_dim"]), (None if global_kv is None else int(global_kv))
    overrides = {int(i): dict(o or {}) for i, o in per_layer.items()}
    by_type: dict[str, set] = {FULL_ATTENTION: set(), SLIDING_ATTENTION: set()}
    for i, kind in enumerate(layer_types):
        o = overrides.get(i, {})
        unknown = sorted(set(o) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise ValueError(f"per_layer_config.{i} overrides {unknown}; spec_jax reads only head_dim and num_key_value_heads.")
        by_type[kind].add((int(o.get("head_dim", head_dim)), int(o.get("num_key_value_heads", kv_heads))))
    if by_type[SLIDING_ATTENTION] - {(head_dim, kv_heads)} or len(by_type[FULL_ATTENTION]) > 1:
        raise ValueError(
            "per_layer_config gives layers of one type different head sizes or KV heads; spec_jax's "
            "Gemma 4 has one shape for the sliding layers (the global fields) and one for the full ones."
        )
    global_dim, global_kv = next(iter(by_type[FULL_ATTENTION]), (head_dim, kv_heads))
    return global_dim, global_kv


def _gemma4_to_hf(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    types = [FULL_ATTENTION if cfg.is_full_attention(i) else SLIDING_ATTENTION for i in range(cfg.num_layers)]
    full_rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        full_rope = {**rope_scaling_to_hf(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    local_rope = {"rope_type": "default", "rope_theta": cfg.sliding_rope_theta or cfg.rope_theta}
    if cfg.sliding_rope_scaling is not None:
        local_rope = {**rope_scaling_to_hf(cfg.sliding_rope_scaling), "rope_theta": local_rope["rope_theta"]}
    for field in ("rope_theta", "rope_scaling", "hidden_act"):
        hf.pop(field, None)
    global_override = {"head_dim": cfg.layer_head_dim(cfg.num_layers - 1),
                       "num_key_value_heads": cfg.layer_kv_heads(cfg.num_layers - 1)}
    hf.update(
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=cfg.final_logit_softcapping,
        sliding_window=cfg.sliding_window or GEMMA4_TEXT_DEFAULTS["sliding_window"],
        layer_types=types,
        rope_parameters={FULL_ATTENTION: full_rope, SLIDING_ATTENTION: local_rope},
        global_head_dim=global_override["head_dim"],
        num_global_key_value_heads=cfg.num_global_kv_heads,
        # What transformers >= 5.24 reads (it ignores the two above when this is present).
        per_layer_config={str(i): dict(global_override) for i, t in enumerate(types) if t == FULL_ATTENTION},
        attention_k_eq_v=cfg.attention_k_eq_v,
        num_kv_shared_layers=cfg.num_kv_shared_layers,
        use_double_wide_mlp=cfg.double_wide_mlp,
        hidden_size_per_layer_input=cfg.per_layer_input_size,
        vocab_size_per_layer_input=cfg.per_layer_vocab_size or cfg.vocab_size,
        enable_moe_block=cfg.moe is not None,
    )
    if cfg.moe is not None:
        hf.update(num_experts=cfg.moe.num_experts, top_k_experts=cfg.moe.top_k,
                  moe_intermediate_size=cfg.moe.expert_intermediate_size)
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


def _qwen3_5_from_hf(cls, hf: Mapping[str, Any], arch: str, dtype: str) -> ModelConfig:
    """Qwen3.5 / Qwen3-Next text: Gated DeltaNet layers ("linear_attention") between gated
    full-attention layers with q/k norms and partial RoPE, (1 + w) RMSNorms. A
    Qwen3_5ForConditionalGeneration config's `text_config` is its text decoder."""
    if "text_config" in hf:
        outer = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in hf}
        hf = {**outer, **hf["text_config"]}
    num_layers = int(hf["num_hidden_layers"])
    moe = None
    if hf.get("num_experts"):  # Qwen3-Next, Qwen3.5-MoE: softmax top-k experts + a gated shared expert
        only = set(int(i) for i in hf.get("mlp_only_layers") or ())
        step = int(hf.get("decoder_sparse_step", 1))
        moe = MoeConfig(
            num_experts=int(hf["num_experts"]), top_k=int(hf["num_experts_per_tok"]),
            expert_intermediate_size=int(hf["moe_intermediate_size"]),
            normalize_top_k=bool(hf.get("norm_topk_prob", True)),
            dense_layers=tuple(i for i in range(num_layers) if i in only or (i + 1) % step),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            shared_expert_gate=True,
        )
    layer_types = hf.get("layer_types")
    if layer_types is None:  # as transformers derives them: every full_attention_interval-th is full
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"layer_types {layer_types} must give one of linear_attention / full_attention per layer.")
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rp.get('rope_type')!r}: spec_jax runs Qwen3.5 / Qwen3-Next with default RoPE.")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return cls(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rp.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
        layer_types=tuple(layer_types),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        dtype=dtype,
        norm_offset=1.0,
        linear_num_key_heads=int(hf["linear_num_key_heads"]),
        linear_num_value_heads=int(hf["linear_num_value_heads"]),
        linear_key_head_dim=int(hf["linear_key_head_dim"]),
        linear_value_head_dim=int(hf["linear_value_head_dim"]),
        linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        attn_output_gate=True,
        partial_rotary_factor=float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        moe=moe,
    )


# ----------------------------------------------------------------------------- gpt-oss
# GptOssConfig's defaults (transformers 5): what a gpt-oss config.json may leave out.
GPT_OSS_DEFAULTS = {
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "sliding_window": 128, "tie_word_embeddings": False,
    "attention_bias": True, "num_local_experts": 128, "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rope_theta": 150000.0,
}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def gpt_oss_defaults(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A gpt-oss config.json with GptOssConfig's defaults filled in, as transformers reads it: the
    YaRN RoPE above, and layers alternating sliding (even) / full (odd) without `layer_types`."""
    hf = {**GPT_OSS_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf["rope_parameters"] = {**GPT_OSS_ROPE, "rope_theta": hf["rope_theta"]}
    if not hf.get("layer_types"):
        hf["layer_types"] = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION
                             for i in range(int(hf["num_hidden_layers"]))]
    return hf


def _gpt_oss_from_hf(cls, hf: Mapping[str, Any], dtype: str) -> ModelConfig:
    """gpt-oss: attention sinks, q/k/v/o biases (`attention_bias`), sliding/full layers, YaRN
    RoPE, and a MoE feed-forward of clamped-SwiGLU experts with biases."""
    hf = gpt_oss_defaults(hf)
    num_layers = int(hf["num_hidden_layers"])
    rope_theta, rope_scaling = rope_from_hf(hf)
    layer_types, window = layer_types_from_hf(hf, num_layers, "gpt_oss")
    bias = bool(hf["attention_bias"])
    return cls(
        **_shape_fields(hf),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        layer_types=layer_types,
        sliding_window=window,
        architecture="gpt_oss",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        dtype=dtype,
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        **_gpt_oss_moe_from_hf(hf),
    )


def _gpt_oss_to_hf(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    hf.pop("rope_theta")
    hf.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(rope_scaling_to_hf(cfg.rope_scaling))
    sliding = [w for w in cfg.layer_windows if w != GLOBAL_WINDOW]
    hf.update(
        attention_bias=cfg.qkv_bias,
        rope_parameters=rope,
        sliding_window=sliding[0] if sliding else None,
        layer_types=[FULL_ATTENTION if w == GLOBAL_WINDOW else SLIDING_ATTENTION for w in cfg.layer_windows],
        **_gpt_oss_moe_to_hf(cfg),
    )
    return hf


def _gpt_oss_moe_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss's MoE block: every layer, the top k router logits (router with a bias) softmaxed,
    clamped-SwiGLU experts with biases."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r}: gpt-oss's experts are a clamped SwiGLU (silu).")
    return {"moe": MoeConfig(
        num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["intermediate_size"]), router_scoring="topk_softmax",
        router_bias=True, expert_bias=True, expert_activation="clamped_swiglu",
        swiglu_alpha=float(hf["swiglu_alpha"]), swiglu_limit=float(hf["swiglu_limit"]),
    )}


def _gpt_oss_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    if moe is None or moe.dense_layers or moe.shared_expert_intermediate_size or moe.router_scoring != "topk_softmax":
        raise ValueError("gpt-oss has experts on every layer, no shared expert and top-k-then-softmax routing.")
    return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "intermediate_size": moe.expert_intermediate_size, "swiglu_alpha": moe.swiglu_alpha,
            "swiglu_limit": moe.swiglu_limit}


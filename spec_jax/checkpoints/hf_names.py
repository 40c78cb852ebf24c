"""HF weight names, one table per family: our params key -> HF name and layout.

The decoder's weights are the same few arrays in every family (`spec_jax.models.weights`); what
differs is what HF calls them. Llama, Mistral and Qwen3 (and the DFlash / EAGLE-3 drafters) use
`DECODER_LAYER`; Qwen2 adds the q/k/v biases; Gemma 3 names its four norms differently: its
`post_attention_layernorm` is the norm on the attention OUTPUT (our `post_attn_norm`), and the
MLP's input norm is `pre_feedforward_layernorm` (Llama's `post_attention_layernorm`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

# in_axes value of a bias: stored [heads, head_dim] by us, flat [heads * head_dim] by HF.
FLAT = -1
# in_axes value of a fused expert tensor: [E, out, in] by HF, [E, in, out] by us.
EXPERTS_T = -2


@dataclasses.dataclass(frozen=True)
class HFWeight:
    """One weight: our params key, its HF name, and how many leading axes of ours are HF's input.

    in_axes == 0 means the array is copied as is (norms, the embedding table); FLAT (-1) means a
    vector HF stores flat (a bias [N, D] is HF's [N * D]). A per-expert weight (MoE) has `{e}` in
    its hf_name: ours is stacked [E, ...] on a leading expert axis, HF holds one tensor per expert.
    interleaved 0 / 1: ours is the even / odd entries of the HF tensor's last axis, which holds two
    of our arrays side by side (gpt-oss's experts: gate and up interleaved in `gate_up_proj`).
    half 0 / 1: ours is the first / second half of the HF tensor's axis -2, which holds two of our
    arrays one after the other (transformers 5's fused `gate_up_proj` [E, 2F, H]: gate, then up).
    in_axes EXPERTS_T: every expert's torch Linear weight on a leading expert axis, [E, out, in]
    (ours [E, in, out]).
    """

    name: str
    hf_name: str
    in_axes: int
    interleaved: int | None = None
    half: int | None = None


DECODER_LAYER: tuple[HFWeight, ...] = (
    HFWeight("attn_norm", "input_layernorm.weight", 0),
    HFWeight("wq", "self_attn.q_proj.weight", 1),  # [N*D, H] -> [H, N, D]
    HFWeight("wk", "self_attn.k_proj.weight", 1),  # [Kv*D, H] -> [H, Kv, D]
    HFWeight("wv", "self_attn.v_proj.weight", 1),  # [Kv*D, H] -> [H, Kv, D]
    HFWeight("wo", "self_attn.o_proj.weight", 2),  # [H, N*D] -> [N, D, H]
    HFWeight("q_norm", "self_attn.q_norm.weight", 0),
    HFWeight("k_norm", "self_attn.k_norm.weight", 0),
    HFWeight("mlp_norm", "post_attention_layernorm.weight", 0),
    HFWeight("hidden_norm", "hidden_norm.weight", 0),  # EAGLE-3's first layer
    HFWeight("w_gate", "mlp.gate_proj.weight", 1),  # [F, H] -> [H, F]
    HFWeight("w_up", "mlp.up_proj.weight", 1),  # [F, H] -> [H, F]
    HFWeight("w_down", "mlp.down_proj.weight", 1),  # [H, F] -> [F, H]
)

QWEN2_LAYER: tuple[HFWeight, ...] = DECODER_LAYER + (
    HFWeight("bq", "self_attn.q_proj.bias", FLAT),  # [N*D] -> [N, D]
    HFWeight("bk", "self_attn.k_proj.bias", FLAT),  # [Kv*D] -> [Kv, D]
    HFWeight("bv", "self_attn.v_proj.bias", FLAT),
)

_GEMMA3_NORMS = {
    "attn_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",  # NOT the MLP's input norm
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
GEMMA3_LAYER: tuple[HFWeight, ...] = tuple(
    w for w in DECODER_LAYER if w.name not in _GEMMA3_NORMS and w.name != "hidden_norm"
) + tuple(HFWeight(name, hf_name, 0) for name, hf_name in _GEMMA3_NORMS.items())

# Gemma 4: Gemma 3's names, plus the per-layer-embedding branch and the layer scalar (a layer
# that reads another's keys/values has no k_proj / v_proj / k_norm; a full-attention layer with
# attention_k_eq_v no v_proj: those are absent from its specs, so never looked up).
GEMMA4_LAYER: tuple[HFWeight, ...] = GEMMA3_LAYER + (
    HFWeight("per_layer_gate", "per_layer_input_gate.weight", 1),  # [P, H] -> [H, P]
    HFWeight("per_layer_proj", "per_layer_projection.weight", 1),  # [H, P] -> [P, H]
    HFWeight("per_layer_norm", "post_per_layer_input_norm.weight", 0),
    HFWeight("layer_scalar", "layer_scalar", 0),  # [1]
    # The MoE variant (26B-A4B): router and experts beside the dense `mlp`, outside it, the experts
    # always fused as transformers holds them ([E, 2F, H] gate then up rows; [E, H, F]).
    HFWeight("router", "router.proj.weight", 1),  # [E, H] -> [H, E]
    HFWeight("router_norm", "router.scale", 0),  # [H]
    HFWeight("router_expert_scale", "router.per_expert_scale", 0),  # [E]
    HFWeight("experts_w_gate", "experts.gate_up_proj", EXPERTS_T, half=0),  # [E, 2F, H] -> [E, H, F]
    HFWeight("experts_w_up", "experts.gate_up_proj", EXPERTS_T, half=1),
    HFWeight("experts_w_down", "experts.down_proj", EXPERTS_T),  # [E, H, F] -> [E, F, H]
    HFWeight("mlp_out_norm", "post_feedforward_layernorm_1.weight", 0),
    HFWeight("experts_norm", "pre_feedforward_layernorm_2.weight", 0),
    HFWeight("experts_out_norm", "post_feedforward_layernorm_2.weight", 0),
)

# Qwen3.5 / Qwen3-Next: the plain names on the gated full-attention layers (q_proj holds [query,
# gate] per head: our wq [H, N, 2D]); Gated DeltaNet under `linear_attn.` on the others (Qwen3.5's
# separate projections, or Qwen3-Next's grouped in_proj_qkvz / in_proj_ba [Hk * c, H] -> [H, Hk, c]).
QWEN3_5_LAYER: tuple[HFWeight, ...] = DECODER_LAYER + (
    HFWeight("linear_qkv", "linear_attn.in_proj_qkv.weight", 1),  # [C, H] -> [H, C]
    HFWeight("linear_z", "linear_attn.in_proj_z.weight", 1),
    HFWeight("linear_b", "linear_attn.in_proj_b.weight", 1),
    HFWeight("linear_a", "linear_attn.in_proj_a.weight", 1),
    HFWeight("linear_qkvz", "linear_attn.in_proj_qkvz.weight", 1),
    HFWeight("linear_ba", "linear_attn.in_proj_ba.weight", 1),
    HFWeight("conv", "linear_attn.conv1d.weight", 0),  # [C, 1, kernel] both sides
    HFWeight("dt_bias", "linear_attn.dt_bias", 0),
    HFWeight("A_log", "linear_attn.A_log", 0),
    HFWeight("linear_norm", "linear_attn.norm.weight", 0),
    HFWeight("linear_out", "linear_attn.out_proj.weight", 1),  # [H, Hv*dv] -> [Hv*dv, H]
)

# Mixture-of-experts layers (spec_jax.models.moe): the dense family's table plus the router and one
# HF tensor per expert, as hub checkpoints and transformers' save_pretrained write them (5.x
# fuses them into 3-D `experts.gate_up_proj` / `experts.down_proj` in memory only). A dense layer
# of the same model (mlp_only_layers) keeps the plain `mlp.*_proj` names.
_QWEN_MOE_FFN: tuple[HFWeight, ...] = (
    HFWeight("router", "mlp.gate.weight", 1),  # [E, H] -> [H, E]
    HFWeight("experts_w_gate", "mlp.experts.{e}.gate_proj.weight", 1),  # E x [F, H] -> [E, H, F]
    HFWeight("experts_w_up", "mlp.experts.{e}.up_proj.weight", 1),  # E x [F, H] -> [E, H, F]
    HFWeight("experts_w_down", "mlp.experts.{e}.down_proj.weight", 1),  # E x [H, F] -> [E, F, H]
    HFWeight("shared_w_gate", "mlp.shared_expert.gate_proj.weight", 1),  # [S, H] -> [H, S]
    HFWeight("shared_w_up", "mlp.shared_expert.up_proj.weight", 1),
    HFWeight("shared_w_down", "mlp.shared_expert.down_proj.weight", 1),  # [H, S] -> [S, H]
    HFWeight("shared_gate", "mlp.shared_expert_gate.weight", 1),  # [1, H] -> [H, 1]
)
QWEN3_MOE_LAYER: tuple[HFWeight, ...] = DECODER_LAYER + _QWEN_MOE_FFN
QWEN2_MOE_LAYER: tuple[HFWeight, ...] = QWEN2_LAYER + _QWEN_MOE_FFN
MIXTRAL_LAYER: tuple[HFWeight, ...] = DECODER_LAYER + (
    HFWeight("router", "block_sparse_moe.gate.weight", 1),
    HFWeight("experts_w_gate", "block_sparse_moe.experts.{e}.w1.weight", 1),
    HFWeight("experts_w_up", "block_sparse_moe.experts.{e}.w3.weight", 1),
    HFWeight("experts_w_down", "block_sparse_moe.experts.{e}.w2.weight", 1),
)

# transformers 5 holds a MoE layer's experts fused in memory, `experts.gate_up_proj` [E, 2F, H]
# (gate rows, then up rows) and `experts.down_proj` [E, H, F], and writes them so with
# `save_pretrained(..., save_original_format=False)`; Mixtral's block is `mlp` there. A checkpoint
# holding `experts.gate_up_proj` reads through these names (`layer_table(..., fused_experts=True)`).
_FUSED_EXPERTS: tuple[HFWeight, ...] = (
    HFWeight("experts_w_gate", "mlp.experts.gate_up_proj", EXPERTS_T, half=0),  # [E, 2F, H] -> [E, H, F]
    HFWeight("experts_w_up", "mlp.experts.gate_up_proj", EXPERTS_T, half=1),
    HFWeight("experts_w_down", "mlp.experts.down_proj", EXPERTS_T),  # [E, H, F] -> [E, F, H]
)
_FUSED_LAYER_NAMES = {
    "qwen3_moe": _FUSED_EXPERTS,
    "qwen2_moe": _FUSED_EXPERTS,
    "mixtral": _FUSED_EXPERTS + (HFWeight("router", "mlp.gate.weight", 1),),
    "qwen3_5": _FUSED_EXPERTS,  # Qwen3.5-MoE
    "qwen3_next": _FUSED_EXPERTS,
}
FUSED_EXPERTS_MARK = "mlp.experts.gate_up_proj"  # the tensor that tells a fused checkpoint

# gpt-oss: Qwen2's q/k/v biases plus the output projection's, the attention sinks, and the MoE
# block (spec_jax.models.moe) with its router bias and expert biases. The experts are stored
# [E, in, out] as we hold them, gate and up interleaved in one tensor (MXFP4-packed in the
# published checkpoints: checkpoints/mxfp4.py reads them as these float tensors).
# Decoder layers with every attention bias (q/k/v/o: `attention_bias` in a Qwen3 / gpt-oss
# config): the DFlash drafters' layers (z-lab's gpt-oss drafters have them).
BIASED_DECODER_LAYER: tuple[HFWeight, ...] = QWEN2_LAYER + (HFWeight("bo", "self_attn.o_proj.bias", 0),)
GPT_OSS_LAYER: tuple[HFWeight, ...] = tuple(w for w in BIASED_DECODER_LAYER if not w.name.startswith("w_")) + (
    HFWeight("sinks", "self_attn.sinks", 0),
    HFWeight("router", "mlp.router.weight", 1),  # [E, H] -> [H, E]
    HFWeight("router_bias", "mlp.router.bias", 0),
    HFWeight("experts_w_gate", "mlp.experts.gate_up_proj", 0, interleaved=0),  # [E, H, 2F] -> [E, H, F]
    HFWeight("experts_w_up", "mlp.experts.gate_up_proj", 0, interleaved=1),
    HFWeight("experts_b_gate", "mlp.experts.gate_up_proj_bias", 0, interleaved=0),  # [E, 2F] -> [E, F]
    HFWeight("experts_b_up", "mlp.experts.gate_up_proj_bias", 0, interleaved=1),
    HFWeight("experts_w_down", "mlp.experts.down_proj", 0),  # [E, F, H] both sides
    HFWeight("experts_b_down", "mlp.experts.down_proj_bias", 0),
)

MODEL_WEIGHTS: tuple[HFWeight, ...] = (
    HFWeight("embed", "model.embed_tokens.weight", 0),  # [V, H] both sides
    HFWeight("final_norm", "model.norm.weight", 0),
    HFWeight("lm_head", "lm_head.weight", 1),  # [V, H] -> [H, V]
    # Gemma 4's per-layer embeddings.
    HFWeight("per_layer_embed", "model.embed_tokens_per_layer.weight", 0),  # [Vp, L*P] both sides
    HFWeight("per_layer_model_proj", "model.per_layer_model_projection.weight", 1),  # [L*P, H] -> [H, L*P]
    HFWeight("per_layer_proj_norm", "model.per_layer_projection_norm.weight", 0),
)

_LAYER_TABLES = {
    "llama": DECODER_LAYER,
    "mistral": DECODER_LAYER,
    "qwen3": DECODER_LAYER,
    "qwen2": QWEN2_LAYER,
    "gemma3": GEMMA3_LAYER,
    "qwen3_moe": QWEN3_MOE_LAYER,
    "qwen2_moe": QWEN2_MOE_LAYER,
    "mixtral": MIXTRAL_LAYER,
    "gemma4": GEMMA4_LAYER,
    "qwen3_5": QWEN3_5_LAYER + _QWEN_MOE_FFN,  # the MoE names serve Qwen3.5-MoE / Qwen3-Next
    "qwen3_next": QWEN3_5_LAYER + _QWEN_MOE_FFN,
    "gpt_oss": GPT_OSS_LAYER,
}


def layer_table(architecture: str | None = None, fused_experts: bool = False) -> Mapping[str, HFWeight]:
    """{our layer key: HFWeight} of a family (None: the plain decoder table the drafters use);
    `fused_experts`: a MoE family's experts as transformers 5's fused 3-D tensors (gpt-oss's
    names are those either way)."""
    table = DECODER_LAYER if architecture is None else _LAYER_TABLES.get(architecture)
    if table is None:
        raise ValueError(f"no HF name table for architecture {architecture!r}; add one to hf_names.py")
    fused = _FUSED_LAYER_NAMES.get(architecture, ()) if fused_experts else ()
    return {w.name: w for w in table + fused}


def expert_parts(w: HFWeight, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """(HF name, expert index) of each HF tensor behind one weight of ours of `shape`: a per-expert
    weight (`{e}` in its hf_name) is shape[0] tensors, any other one tensor (index None)."""
    if "{e}" not in w.hf_name:
        return [(w.hf_name, None)]
    return [(w.hf_name.format(e=e), e) for e in range(shape[0])]


MODEL_TABLE: Mapping[str, HFWeight] = {w.name: w for w in MODEL_WEIGHTS}

# Gemma3ForConditionalGeneration checkpoints: the text decoder under `language_model` (hub files:
# `language_model.model.*`, `language_model.lm_head.*`; transformers >= 4.52 saves
# `model.language_model.*`), next to a vision tower spec_jax does not run.
_MULTIMODAL_TEXT = (
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
)
_MULTIMODAL_OTHER = re.compile(
    r"^(model\.)?(vision_tower|multi_modal_projector|audio_tower|embed_vision|embed_audio|visual)\."
)


def multimodal_text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name -> the text decoder's HF name, or None for a tensor
    of the vision part (skipped)."""
    if _MULTIMODAL_OTHER.match(name):
        return None
    for pattern, replacement in _MULTIMODAL_TEXT:
        if pattern.match(name):
            return pattern.sub(replacement, name, count=1)
    return name

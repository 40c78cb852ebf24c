"""The MTP head Qwen3.5 and Qwen3-Next checkpoints carry (`mtp.*`), as a drafter.

Those checkpoints hold, next to the decoder, one multi-token-prediction layer (transformers skips
the `mtp.*` tensors on load; vLLM runs them as `qwen3_next_mtp` / `qwen3_5_mtp`, SGLang as
`Qwen3NextForCausalLMMTP`). Per pair t = (the target's hidden state of token t, token t + 1):

  x      = fc(concat[pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(hidden t)])  [B, T, H]
  x      = one full-attention decoder layer of the target's own kind (Qwen3.5's gated attention
           with q/k norms and partial RoPE; a MoE MLP in Qwen3-Next / Qwen3.5-MoE), attending
           causally over every earlier pair (so it keeps a KV cache of its own)
  out    = norm(x);  logits = the target's LM head (out), predicting token t + 2

The norms are the family's (1 + w) RMSNorms; embedding first, hidden state second in the concat;
`fc` has no bias. The hidden state fed is the target's FINAL-normed one (what its LM head reads:
vLLM and SGLang hand the drafter the model's returned, normed hidden states), and K > 1 drafts
chain the one MTP layer on its own output: draft j + 1's pair is (out of draft j, draft j). This
follows vLLM's `vllm/model_executor/models/qwen3_next_mtp.py` (commit 055e47c) and
`qwen3_5_mtp.py` (commit 01d9980), and SGLang's `python/sglang/srt/models/qwen3_next_mtp.py`
(commit 0053421). vLLM places pair t at RoPE position t, spec_jax's pair cache at t + 1: the
attention sees relative positions only, so the logits are the same.

The chain, the tree and the pair cache that catches up on accepted tokens are
`spec_jax.drafters.pair_cache`'s (shared with EAGLE-3); this module is the network. Its params
are a plain pytree (`mtp_weight_specs`): `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
`layers` (one decoder layer's weights, `spec_jax.models.weights`' names) and `norm`; the
embedding and LM head are the target's, read through `Target`. `spec_jax.checkpoints.qwen_mtp`
reads them from the target's own checkpoint (`--drafter mtp=TARGET_DIR`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.pair_cache import PairCacheConfig, PairCacheDrafter
from spec_jax.models.config import FULL_ATTENTION, ModelConfig
from spec_jax.models.decoder import decoder_layer, einsum, layer_style, rms_norm, rope_inv_freq
from spec_jax.models.interface import FINAL_HIDDEN, Target, TargetModel
from spec_jax.models.weights import WeightSpec, init_from_specs, model_weight_specs

Params = Any
NAME = "Qwen3.5 / Qwen3-Next MTP head (--drafter mtp)"


@dataclasses.dataclass(frozen=True)
class QwenMtpConfig(PairCacheConfig):
    """Static hyperparameters of the MTP head (hashable).

    layer: the MTP layer's config: the target's, with one layer, of type full_attention (its
      MLP a MoE block when the target's are). default_k: drafts per step when the caller names
      none (vLLM's examples use num_speculative_tokens 2 for these models)."""

    layer: ModelConfig
    default_k: int = 2

    def __post_init__(self):
        if self.layer.num_layers != 1:
            raise ValueError(
                f"the MTP head has {self.layer.num_layers} layers; spec_jax runs the one-layer heads "
                "Qwen3.5 / Qwen3-Next ship (mtp_num_hidden_layers = 1). vLLM runs layer j mod n "
                "at draft step j for more."
            )

    @classmethod
    def from_target(cls, target: ModelConfig, num_layers: int = 1, default_k: int = 2) -> "QwenMtpConfig":
        """The head of a target `ModelConfig` (Qwen3.5 / Qwen3-Next, or any decoder config):
        its full-attention layer, its MLP or MoE block, its norms."""
        moe = target.moe
        if moe is not None:  # vLLM numbers the MTP layer 0: dense when target layer 0 would be
            moe = dataclasses.replace(moe, dense_layers=tuple(i for i in moe.dense_layers if i < num_layers))
        layer = target.replace(num_layers=num_layers, layer_types=(FULL_ATTENTION,) * num_layers, moe=moe)
        return cls(layer=layer, default_k=default_k)


def mtp_weight_specs(cfg: QwenMtpConfig) -> dict[str, Any]:
    """The head's weights; its norms scale by (norm_offset + w) like the target's."""
    layer = cfg.layer
    H = layer.hidden_size
    norm_init = "zeros" if layer.norm_offset == 1.0 else "ones"
    norm = WeightSpec((H,), (None,), norm_init)
    return {
        "fc": WeightSpec((2 * H, H), (None, "embed")),
        "pre_fc_norm_embedding": norm,
        "pre_fc_norm_hidden": norm,
        "layers": model_weight_specs(layer)["layers"],
        "norm": norm,
    }


def init_mtp_params(cfg: QwenMtpConfig, key: jax.Array, scale: float = 1.0) -> Params:
    """Random weights (tests, training from scratch)."""
    return init_from_specs(mtp_weight_specs(cfg), key, jnp.dtype(cfg.layer.dtype), scale)


def check_compatible(cfg: QwenMtpConfig, target: TargetModel) -> None:
    problems = []
    if cfg.layer.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary ({cfg.layer.vocab_size} tokens) differs from the target's "
                        f"({target.vocab_size})")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"it reads {cfg.hidden_size}-wide hidden states, the target's are {target.hidden_size} wide")
    if problems:
        raise ValueError(f"{NAME} does not fit this target: " + "; ".join(problems)
                         + ". Load the head from the target's own checkpoint (--drafter mtp=TARGET_DIR).")


# ----------------------------------------------------------------------------- the network
def mtp_layers(cfg: QwenMtpConfig, params: Params, target: Target, tokens: jax.Array, hidden: jax.Array,
               positions: jax.Array, attend_to: Any) -> tuple[jax.Array, list[Any]]:
    """Pairs (token ids [B, T], hidden states [B, T, H]) at positions [B, T] -> (the MTP
    layer's output [B, T, H] before the final norm, what each layer's attend_to returned)."""
    layer = cfg.layer
    eps, offset = layer.rms_norm_eps, layer.norm_offset
    dtype = params["fc"].dtype
    embeds = rms_norm(target.embed(tokens).astype(dtype), params["pre_fc_norm_embedding"], eps, offset)
    hidden = rms_norm(hidden.astype(dtype), params["pre_fc_norm_hidden"], eps, offset)
    x = einsum("btc,ch->bth", jnp.concatenate([embeds, hidden], axis=-1), params["fc"])
    inv_freq = rope_inv_freq(int(layer.head_dim * layer.partial_rotary_factor), *layer.layer_rope(0))
    style = layer_style(layer)
    auxes = []
    for i, lp in enumerate(params["layers"]):
        with jax.named_scope(f"mtp_layer_{i}"):
            x, aux = decoder_layer(lp, x, positions, inv_freq, eps, attend_to(i), style=style)
        auxes.append(aux)
    return x, auxes


def mtp_head(cfg: QwenMtpConfig, params: Params, target: Target, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Layer output [B, T, H] -> (float32 logits [B, T, V] by the target's LM head, the normed
    output: the hidden state the next chain step reads)."""
    normed = rms_norm(out, params["norm"], cfg.layer.rms_norm_eps, cfg.layer.norm_offset)
    return target.logits(normed), normed


# ----------------------------------------------------------------------------- the drafter
@dataclasses.dataclass(frozen=True)
class QwenMtpDrafter(PairCacheDrafter):
    """The MTP head as a drafter (see the module docstring). Hashable.

    k: drafts per verify step (default cfg.default_k). sample_drafts: at temperature > 0 sample
    each chain draft from the warped draft distribution (exact acceptance); False keeps argmax
    drafts. tree: 0 a chain; N an EAGLE-2-style tree of N nodes."""

    cfg: QwenMtpConfig
    k: int | None = None
    sample_drafts: bool = True
    tree: Any = 0

    def __post_init__(self):
        self.settle_k(self.cfg.default_k, "The MTP head")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (FINAL_HIDDEN,)

    def weight_specs(self) -> dict[str, Any]:
        return mtp_weight_specs(self.cfg)

    def validate(self, target: TargetModel, capacity: int) -> None:
        check_compatible(self.cfg, target)

    def pair_features(self, params, captured):
        return captured

    def pair_layers(self, params, target, tokens, hidden, positions, attend_to):
        return mtp_layers(self.cfg, params, target, tokens, hidden, positions, attend_to)

    def pair_head(self, params, target, out):
        return mtp_head(self.cfg, params, target, out)

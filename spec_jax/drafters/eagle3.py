"""EAGLE-3: a one-layer (or few-layer) chain drafter fed by three of the target's hidden states.

Pair t of a sequence is (target features of token t, token t + 1); at RoPE position t + 1 it
predicts token t + 2. Per verify step:

  fused    = fc(concat of the target's hidden states at `aux_layer_ids`)       [B, T, H]
  layer 0  = attention over q/k/v of [norm(embed(token)), hidden_norm(fused)], residual = fused
             (or the normed fused features with norm_before_residual), then the MLP;
             further layers are plain decoder layers
  logits   = lm_head(norm(out)) over the draft vocabulary, mapped onto the target's with d2t
             (target id = draft id + d2t[draft id]); ids outside the draft vocabulary get -inf
  chain    = the next pair is (out, the draft just chosen), one position further, attending to
             every real pair and to the chain so far; K drafts in all

The drafter keeps a KV cache of the real pairs (those with target features), indexed by pair:
slot t holds pair t's keys in every draft layer. The features of the last verified inputs wait in
`pending` until `propose` knows the tokens that complete their pairs (the bonus token is sampled
after `commit`), so a rejected draft is rolled back by the per-row pair count alone. That machine
(init, commit, the chain, the tree) is `spec_jax.drafters.pair_cache`'s, shared with the MTP head
of Qwen3.5 / Qwen3-Next; this module is EAGLE-3's network.

`aux_layer_ids` follow the speculators / vLLM convention: id i is the input of target layer i
(HF `hidden_states[i]`), i.e. spec_jax's capture of layer i - 1; id == num_layers is the last
layer's output before the final norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.draft_vocab import draft_logits_of, draft_vocab_specs, to_target_vocab
from spec_jax.drafters.pair_cache import PairCacheConfig, PairCacheDrafter, PairCacheState
from spec_jax.models.config import GLOBAL_WINDOW, ModelConfig
from spec_jax.models.decoder import decoder_layer, einsum, embed, rms_norm, rope_inv_freq
from spec_jax.models.interface import Target, TargetModel
from spec_jax.models.weights import WeightSpec, init_from_specs, layer_weight_specs

Params = Any


def default_aux_layer_ids(num_target_layers: int, distinct: bool = False) -> tuple[int, ...]:
    """EAGLE-3's default feature layers (vLLM, speculators): low, middle and high, (2, L/2, L-3),
    within 1..L. Heads published without their ids were trained with exactly these (repeats
    included for shallow targets); `distinct` drops repeats, for new heads."""
    n = num_target_layers
    ids = tuple(min(max(i, 1), n) for i in (2, n // 2, n - 3))
    return tuple(sorted(set(ids))) if distinct else ids


@dataclasses.dataclass(frozen=True)
class Eagle3Config(PairCacheConfig):
    """Static hyperparameters of an EAGLE-3 drafter (hashable).

    layer:            the draft decoder layers' config (Llama or Qwen3; vocab_size = target vocab)
    draft_vocab_size: rows of the drafter's LM head (<= the target vocabulary)
    aux_layer_ids:    target feature layers, speculators convention (see the module doc)
    own_embedding:    the checkpoint carries embed_tokens; else the target's embedding is used
    """

    layer: ModelConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    own_embedding: bool = True
    num_target_layers: int | None = None
    speculative_tokens: int = 3  # the checkpoint's proposal length: the default K

    def __post_init__(self):
        # The draft layers run the plain Llama/Qwen3 math whatever the target's family (a config
        # copied from a Gemma or Qwen2 target would otherwise claim its norms and biases).
        object.__setattr__(self, "layer", self.layer.plain_decoder())
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if not self.aux_layer_ids:
            raise ValueError("EAGLE-3 aux_layer_ids is empty; name the target layers it reads.")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("EAGLE-3 norm_before_fc and fc_norm are mutually exclusive; set one.")
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(
                f"EAGLE-3 draft_vocab_size {self.draft_vocab_size} must be in 1..{self.layer.vocab_size} "
                "(the target vocabulary)."
            )
        if any(w != GLOBAL_WINDOW for w in self.layer.layer_windows):
            raise ValueError("EAGLE-3 drafters with sliding-window layers are not supported.")

    @property
    def feature_size(self) -> int:
        """Width of one target hidden state."""
        return self.target_hidden_size or self.layer.hidden_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """spec_jax capture ids (output of layer i) of the aux layers (input of layer i)."""
        return tuple(i - 1 for i in self.aux_layer_ids)

    @property
    def dtype(self) -> str:
        return self.layer.dtype


def eagle3_weight_specs(cfg: Eagle3Config) -> dict[str, Any]:
    """The drafter's weights. Layer 0 projects q/k/v from 2H inputs and has a hidden_norm; its
    attn_norm is the input_layernorm applied to the token embedding."""
    c = cfg.layer
    H, n, F = c.hidden_size, len(cfg.aux_layer_ids), cfg.feature_size
    layer_kwargs = dict(hidden=H, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                        head_dim=c.head_dim, intermediate=c.intermediate_size, qk_norm=c.qk_norm)
    first = layer_weight_specs(**layer_kwargs)
    for name in ("wq", "wk", "wv"):
        first[name] = WeightSpec((2 * H,) + first[name].shape[1:], first[name].axes)
    first["hidden_norm"] = WeightSpec((H,), (None,), "ones")
    specs: dict[str, Any] = {
        "fc": WeightSpec((n * F, H), (None, "embed")),
        "layers": [first] + [layer_weight_specs(**layer_kwargs) for _ in range(c.num_layers - 1)],
        "norm": WeightSpec((H,), (None,), "ones"),
        **draft_vocab_specs(H, cfg.draft_vocab_size),
    }
    if cfg.norm_before_fc:
        specs["input_norm"] = WeightSpec((n * F,), (None,), "ones")
    if cfg.fc_norm:
        specs["fc_norms"] = [WeightSpec((F,), (None,), "ones") for _ in range(n)]
    if cfg.own_embedding:
        specs["embed"] = WeightSpec((c.vocab_size, H), ("vocab", "embed"))
    return specs


def init_eagle3_params(cfg: Eagle3Config, key: jax.Array, scale: float = 1.0) -> Params:
    params = init_from_specs(eagle3_weight_specs(cfg), key, jnp.dtype(cfg.dtype), scale)
    params["d2t"] = jnp.zeros((cfg.draft_vocab_size,), jnp.int32)  # identity map onto the target
    return params


def check_compatible(cfg: Eagle3Config, target_cfg: TargetModel | ModelConfig) -> None:
    """Raise a ValueError naming every way `cfg` cannot draft for the target (a TargetModel or
    the built-in decoder's ModelConfig: both name vocab_size, hidden_size and num_layers)."""
    problems = []
    if cfg.layer.vocab_size != target_cfg.vocab_size:
        problems.append(
            f"its vocabulary ({cfg.layer.vocab_size} tokens) differs from the target's "
            f"({target_cfg.vocab_size})"
        )
    if cfg.feature_size != target_cfg.hidden_size:
        problems.append(
            f"it reads {cfg.feature_size}-wide target hidden states, the target's are "
            f"{target_cfg.hidden_size} wide"
        )
    if not cfg.own_embedding and cfg.hidden_size != target_cfg.hidden_size:
        problems.append(
            f"it has no embedding of its own and its width {cfg.hidden_size} differs from the "
            f"target's {target_cfg.hidden_size}"
        )
    bad = [i for i in cfg.aux_layer_ids if not 1 <= i <= target_cfg.num_layers]
    if bad:
        problems.append(
            f"aux layer ids {bad} are outside 1..{target_cfg.num_layers} (the inputs of the "
            "target's layers 1.. and its last layer's output; id 0, the embedding, is not supported)"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target_cfg.num_layers:
        problems.append(
            f"it was made for a {cfg.num_target_layers}-layer target, this target has "
            f"{target_cfg.num_layers} layers"
        )
    if problems:
        raise ValueError(
            "EAGLE-3 drafter does not fit this target: " + "; ".join(problems)
            + ". Use the EAGLE-3 checkpoint trained for this target model."
        )


# ----------------------------------------------------------------------------- the network
def fuse_features(cfg: Eagle3Config, params: Params, captured: jax.Array) -> jax.Array:
    """Concatenated target hidden states [B, T, n*F] -> fused features [B, T, H]."""
    x = captured.astype(params["fc"].dtype)
    eps = cfg.layer.rms_norm_eps
    if cfg.norm_before_fc:  # one norm over the concatenation (gpt-oss heads)
        x = rms_norm(x, params["input_norm"], eps)
    if cfg.fc_norm:  # one norm per target layer
        chunks = jnp.split(x, len(cfg.aux_layer_ids), axis=-1)
        x = jnp.concatenate([rms_norm(c, w, eps) for c, w in zip(chunks, params["fc_norms"])], -1)
    return einsum("btc,ch->bth", x, params["fc"])


def eagle3_layers(
    cfg: Eagle3Config,
    params: Params,
    token_embeds: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    attend_to: Any,
) -> tuple[jax.Array, list[Any]]:
    """The draft layers over pairs: token embeddings and hidden inputs (fused target features, or
    the previous chain step's output) [B, T, H] at RoPE positions [B, T]. attend_to(i) gives
    layer i's `decoder_layer` attend_to. -> (output hidden [B, T, H] before the final norm, what
    each layer's attend_to returned)."""
    c = cfg.layer
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    first = params["layers"][0]
    normed_hidden = rms_norm(hidden, first["hidden_norm"], c.rms_norm_eps)
    attn_input = jnp.concatenate(
        [rms_norm(token_embeds, first["attn_norm"], c.rms_norm_eps), normed_hidden], axis=-1
    )
    residual = normed_hidden if cfg.norm_before_residual else hidden
    with jax.named_scope("eagle3_layer_0"):
        x, aux = decoder_layer(first, residual, positions, inv_freq, c.rms_norm_eps, attend_to(0),
                               attn_input=attn_input)
    auxes = [aux]
    for i, lp in enumerate(params["layers"][1:], start=1):
        with jax.named_scope(f"eagle3_layer_{i}"):
            x, aux = decoder_layer(lp, x, positions, inv_freq, c.rms_norm_eps, attend_to(i))
        auxes.append(aux)
    return x, auxes


def eagle3_head(cfg: Eagle3Config, params: Params, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Layer output [B, T, H] -> (draft-vocabulary logits [B, T, Vd] f32, the hidden state the
    next chain step reads: normed with norm_output, else the raw output)."""
    normed = rms_norm(out, params["norm"], cfg.layer.rms_norm_eps)
    return draft_logits_of(params, normed), normed if cfg.norm_output else out


# ----------------------------------------------------------------------------- the drafter
Eagle3State = PairCacheState  # the pair cache and the pending features (`spec_jax.drafters.pair_cache`)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(PairCacheDrafter):
    """The EAGLE-3 drafter (see the module docstring). Hashable: a static argument of the loop.
    The chain, the tree and the pair cache are `PairCacheDrafter`'s; this class is the network.

    k: drafts per verify step (default: the checkpoint's speculative_tokens).
    sample_drafts: at temperature > 0, sample each chain draft from the warped draft distribution
    (mapped onto the target vocabulary) and return those probabilities; False keeps argmax drafts.
    """

    cfg: Eagle3Config
    k: int | None = None
    sample_drafts: bool = True
    tree: Any = 0  # 0: a chain; N: an EAGLE-2-style tree of N nodes (`propose_tree`)

    def __post_init__(self):
        self.settle_k(self.cfg.speculative_tokens, "EAGLE-3")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.capture_layers

    def weight_specs(self) -> dict[str, Any]:
        return eagle3_weight_specs(self.cfg)

    def validate(self, target: TargetModel, capacity: int) -> None:
        check_compatible(self.cfg, target)

    def _embed(self, params: Params, target: Target, tokens: jax.Array) -> jax.Array:
        """The drafter's own embedding when it has one, else the target's."""
        x = embed(params, tokens) if self.cfg.own_embedding else target.embed(tokens)
        return x.astype(params["fc"].dtype)

    def pair_features(self, params, captured):
        return fuse_features(self.cfg, params, captured)

    def pair_layers(self, params, target, tokens, hidden, positions, attend_to):
        return eagle3_layers(self.cfg, params, self._embed(params, target, tokens), hidden, positions, attend_to)

    def pair_head(self, params, target, out):
        logits, hidden = eagle3_head(self.cfg, params, out)
        return to_target_vocab(logits, params["d2t"], self.cfg.layer.vocab_size), hidden

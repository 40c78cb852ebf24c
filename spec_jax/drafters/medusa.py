"""Medusa heads: K small residual MLPs on the target's last hidden state, sharing its LM head.

Medusa-1 (Cai et al., 2024): head i reads the hidden state h of the last position the target has
run and predicts the token i positions after the one the target's own LM head predicts there:

  head_i(h) = lm_head(block_R(..block_1(norm_i(h))))     block(x) = x + SiLU(x W + b)

The target's LM head predicts token t + 1 from the hidden state of token t, so head i predicts
token t + 1 + i. In the speculative loop the last committed token has not been run through the
target yet (it is the root of the next verify pass), so the newest hidden state is that of the
token before it, the one whose LM head output *was* the last committed token: head i there
predicts the i-th token after the last committed one, i.e. draft i. All K drafts come from one
hidden state in one small pass (no cache, no sequential drafting), and each head's distribution
is independent of the others, which makes Medusa tree-native: a tree is the best-first (or a
static) expansion of the K per-depth distributions (`spec_jax.drafters.tree.tree_from_logprobs`).

The heads read the target's last layer *before* its final norm (what the target interface
captures), so every head starts with its own RMSNorm; training initialises it from the target's
final-norm weight, and the residual blocks from zero, so an untrained head is the LM head itself.

State: the captured hidden state [B, H] of position lengths - 2 (taken at prompt_lengths - 1 after
the prefill, and at the last accepted node of each verify pass: `commit`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from spec_jax.drafters.tree import TreeDraft, check_tree_setting, tree_from_logprobs
from spec_jax.models.attention import einsum
from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import rms_norm
from spec_jax.models.interface import Target, TargetModel
from spec_jax.models.weights import WeightSpec, init_from_specs
from spec_jax.sampling import SamplingParams, sample, warp

Params = Any


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """Static hyperparameters of a set of Medusa heads (hashable).

    num_heads:         K, heads = drafts per step at most (head i drafts the i-th next token)
    hidden_size:       the target's hidden size (the heads keep it: they end in its LM head)
    num_target_layers: the target's depth; the heads read its last layer (capture id N - 1)
    num_res_blocks:    residual SiLU blocks per head
    vocab_size:        the target's vocabulary, recorded to refuse another target (None: unchecked)
    """

    num_heads: int
    hidden_size: int
    num_target_layers: int
    num_res_blocks: int = 1
    vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self):
        for name, minimum in (("num_heads", 1), ("hidden_size", 1), ("num_target_layers", 1),
                              ("num_res_blocks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
                raise ValueError(f"Medusa {name} must be an integer >= {minimum}, got {value!r}.")

    @property
    def capture_layer(self) -> int:
        """The target layer the heads read: its last (HF hidden_states[N] before the final norm)."""
        return self.num_target_layers - 1

    @classmethod
    def for_target(cls, target: TargetModel | ModelConfig, num_heads: int = 4, num_res_blocks: int = 1,
                   dtype: str = "float32") -> "MedusaConfig":
        """Heads shaped for a target (a TargetModel or the built-in decoder's ModelConfig)."""
        return cls(num_heads=num_heads, hidden_size=target.hidden_size, num_target_layers=target.num_layers,
                   num_res_blocks=num_res_blocks, vocab_size=target.vocab_size,
                   rms_norm_eps=float(getattr(target, "rms_norm_eps", 1e-6)), dtype=dtype)


def medusa_weight_specs(cfg: MedusaConfig) -> dict[str, Any]:
    """Per head: its RMSNorm and `num_res_blocks` blocks (w [H, H], b [H]); the LM head is the
    target's. The blocks' output width is sharded like an MLP's (column-parallel)."""
    H = cfg.hidden_size

    def head() -> dict[str, Any]:
        return {
            "norm": WeightSpec((H,), (None,), "ones"),
            "blocks": [{"w": WeightSpec((H, H), ("embed", "mlp")), "b": WeightSpec((H,), ("mlp",), "zeros")}
                       for _ in range(cfg.num_res_blocks)],
        }

    return {"heads": [head() for _ in range(cfg.num_heads)]}


def init_medusa_params(cfg: MedusaConfig, key: jax.Array, scale: float = 1.0) -> Params:
    """Random heads (normal blocks, unit norms), e.g. for tests; training starts from
    `identity_medusa_params` instead."""
    return init_from_specs(medusa_weight_specs(cfg), key, jnp.dtype(cfg.dtype), scale)


def identity_medusa_params(cfg: MedusaConfig, norm_weight: Any = None) -> Params:
    """Heads that start as the target's own LM head (Medusa's init): zero blocks, and each norm
    the target's final-norm weight (as it scales, i.e. offset included) when given, else ones."""
    params = init_from_specs(medusa_weight_specs(cfg), jax.random.key(0), jnp.dtype(cfg.dtype))
    zeros = lambda x: jnp.zeros_like(x)  # noqa: E731
    for head in params["heads"]:
        head["blocks"] = jax.tree_util.tree_map(zeros, head["blocks"])
        if norm_weight is not None:
            head["norm"] = jnp.asarray(norm_weight, head["norm"].dtype).reshape(head["norm"].shape)
    return params


def target_final_norm(target: Target) -> jax.Array | None:
    """The target's final-norm weight as it scales (Gemma's 1 + w), when the target is spec_jax's
    decoder; None for other models (the heads' norms then start at one)."""
    cfg = getattr(target.model, "cfg", None)
    if not isinstance(cfg, ModelConfig) or not isinstance(target.params, Mapping):
        return None
    weight = target.params.get("final_norm")
    return None if weight is None else jnp.asarray(weight, jnp.float32) + cfg.norm_offset


def check_compatible(cfg: MedusaConfig, target_cfg: TargetModel | ModelConfig) -> None:
    """Raise a ValueError naming every way the heads cannot draft for this target."""
    problems = []
    if cfg.hidden_size != target_cfg.hidden_size:
        problems.append(
            f"hidden size {cfg.hidden_size} differs from the target's {target_cfg.hidden_size} "
            "(the heads read its last hidden state and end in its LM head)"
        )
    if cfg.num_target_layers != target_cfg.num_layers:
        problems.append(
            f"they were made for a {cfg.num_target_layers}-layer target (they read its last layer), "
            f"this target has {target_cfg.num_layers} layers"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != target_cfg.vocab_size:
        problems.append(
            f"their vocab size {cfg.vocab_size} differs from the target's {target_cfg.vocab_size}"
        )
    if problems:
        raise ValueError(
            "Medusa heads do not fit this target: " + "; ".join(problems) + ". Use heads trained for "
            "this target model (`spec-jax train medusa`)."
        )


def head_hidden(
    cfg: MedusaConfig, params: Params, hidden: jax.Array, num_heads: int | None = None
) -> jax.Array:
    """Captured last-layer hidden states [..., H] -> the first `num_heads` heads' outputs
    [..., K, H], ready for the target's LM head. Shared by drafting and training."""
    outs = []
    for head in params["heads"][: num_heads or cfg.num_heads]:
        x = rms_norm(hidden.astype(head["norm"].dtype), head["norm"], cfg.rms_norm_eps)
        for block in head["blocks"]:
            x = x + jax.nn.silu(einsum("...h,hd->...d", x, block["w"]) + block["b"])
        outs.append(x)
    return jnp.stack(outs, axis=-2)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
    """Medusa heads as a drafter (see the module docstring). Hashable: a static argument of the loop.

    k:             drafts per chain step, 1 .. num_heads (default num_heads); a tree's depth bound.
    tree:          0 for a chain of K drafts; a node budget N for a best-first tree over the K heads'
                   distributions; or a tuple of paths for a static tree (Medusa's own trees are
                   static; `spec_jax.drafters.tree`). Tree nodes are top-k candidates (deterministic).
    sample_drafts: at temperature > 0 a chain's drafts are sampled from the warped head
                   distributions and returned with them; False keeps argmax drafts (one-hot q).
    """

    cfg: MedusaConfig
    k: int | None = None
    tree: Any = 0
    sample_drafts: bool = True
    # propose returns the state unchanged (it changes in commit only): a lookup in front of the
    # heads may skip them on steps where every row takes the lookup (LookupFirstDrafter).
    stateless_propose = True

    def __post_init__(self):
        if self.k is None:
            object.__setattr__(self, "k", self.cfg.num_heads)
        is_int = isinstance(self.k, numbers.Integral) and not isinstance(self.k, bool)
        if not is_int or not 1 <= self.k <= self.cfg.num_heads:
            raise ValueError(
                f"Medusa K must be in 1..{self.cfg.num_heads} (one draft per head; these heads "
                f"number {self.cfg.num_heads}), got {self.k!r}."
            )
        check_tree_setting(self.tree, self.k, static_ok=True, name="Medusa")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.cfg.capture_layer,)

    def weight_specs(self) -> dict[str, Any]:
        return medusa_weight_specs(self.cfg)

    def validate(self, target: TargetModel, capacity: int) -> None:
        check_compatible(self.cfg, target)

    def init(self, params, target: Target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        # The last prompt token's hidden state: its LM head output is the first sampled token.
        rows = jnp.arange(prompt_tokens.shape[0])
        return prefill_captured[rows, prompt_lengths - 1]  # [B, H]

    def commit(self, params, target: Target, state, start, num_accepted, verify_captured):
        # The last accepted node's hidden state: its LM head output is the correction/bonus token.
        rows = jnp.arange(verify_captured.shape[0])
        return verify_captured[rows, num_accepted].astype(state.dtype)  # [B, H]

    def draft_logits(self, params: Params, target: Target, state: jax.Array) -> jax.Array:
        """Float32 logits [B, K, V]: head i's distribution over the i-th token after the last
        committed one."""
        return target.logits(head_hidden(self.cfg, params, state, self.k))

    def propose(self, params, target: Target, state, tokens, lengths, key, sampling: SamplingParams):
        logits = self.draft_logits(params, target, state)  # [B, K, V]
        if not self.sample_drafts:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, state
        probs = warp(logits, sampling)  # one-hot argmax under greedy
        return sample(key, probs), probs, state

    def propose_tree(self, params, target: Target, state, tokens, lengths, key,
                     sampling: SamplingParams) -> tuple[TreeDraft, jax.Array]:
        """A tree over the K heads' independent per-depth distributions: best first up to the
        `tree` budget, or the given static shape."""
        logits = self.draft_logits(params, target, state)  # [B, K, V]
        return tree_from_logprobs(jax.nn.log_softmax(logits, axis=-1), self.tree), state

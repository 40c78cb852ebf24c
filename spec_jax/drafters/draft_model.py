"""A small language model (or the target itself, "self") as drafter, with its own KV cache."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.sampling import SamplingParams, sample, warp
from spec_jax.drafters.base import Target
from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import KVCache, forward, forward_hidden, init_cache, lm_head
from spec_jax.models.weights import model_weight_specs


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """K sequential steps of a draft LM per verify step; drafts sampled from its warped logits.

    The draft cache is indexed by position like the target's, so rejected drafts roll back by
    length alone. Each propose first re-feeds the last K+1 committed tokens, all a verify step can
    add: the draft model has not seen the bonus token (nor d_K after a fully accepted block), and
    the committed tokens need not be its own drafts at all when prompt lookup replaced them
    (`LookupFirstDrafter`). A fixed K+1-token step keeps shapes static; re-writing an already
    cached position with the same token is harmless.
    """

    cfg: ModelConfig
    k: int = 4

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def weight_specs(self) -> dict[str, Any]:
        return model_weight_specs(self.cfg)

    def validate(self, target_cfg: ModelConfig, capacity: int) -> None:
        if self.k < 1:
            raise ValueError(f"K must be >= 1 for a draft model, got {self.k}.")
        small, large = sorted((self.cfg.vocab_size, target_cfg.vocab_size))
        # Checkpoints pad vocabularies to multiples of 64/128; a bigger gap is another tokenizer.
        if large - small > 256:
            raise ValueError(
                f"Draft model vocab ({self.cfg.vocab_size}) and target vocab "
                f"({target_cfg.vocab_size}) differ by more than padding: the drafter must use the "
                "target's tokenizer. Pick a draft model from the same family."
            )

    def _draft_probs(self, logits: jax.Array, target_vocab: int, sampling: SamplingParams) -> jax.Array:
        """Draft logits [B, V_d] -> warped probs over the target's vocabulary [B, V_t]."""
        vd = logits.shape[-1]
        if vd > target_vocab:
            logits = logits[:, :target_vocab]
        elif vd < target_vocab:
            logits = jnp.pad(logits, ((0, 0), (0, target_vocab - vd)), constant_values=-jnp.inf)
        return warp(logits, sampling)

    def init(self, params, target: Target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        batch, prompt_len = prompt_tokens.shape
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
        cache = init_cache(self.cfg, batch, capacity)
        _, _, cache = forward(params, self.cfg, prompt_tokens, positions, cache)
        return cache.with_lengths(prompt_lengths)

    def propose(self, params, target: Target, state: KVCache, tokens, lengths, key, sampling):
        batch = tokens.shape[0]
        rows = jnp.arange(batch)
        vocab = target.cfg.vocab_size
        keys = jax.random.split(key, self.k)
        # Draft step 1: the last K+1 committed tokens at positions L-K-1 .. L-1 (clipped at 0 for
        # short prompts: a repeated position 0 writes the same keys twice). Logits at L-1 only.
        pos = jnp.maximum(lengths[:, None] - self.k - 1 + jnp.arange(self.k + 1, dtype=jnp.int32), 0)
        inputs = tokens[rows[:, None], pos]
        hidden, _, cache = forward_hidden(params, self.cfg, inputs, pos, state)
        logits = lm_head(params, self.cfg, hidden[:, -1:])  # [B, 1, V_d]
        probs = self._draft_probs(logits[:, 0], vocab, sampling)  # [B, V]
        draft = sample(keys[0], probs)

        # Draft steps 2..K: feed the previous draft at the next position.
        def step(carry, step_key):
            cache, draft, position = carry
            logits, _, cache = forward(params, self.cfg, draft[:, None], position[:, None], cache)
            probs = self._draft_probs(logits[:, 0], vocab, sampling)
            nxt = sample(step_key, probs)
            return (cache, nxt, position + 1), (nxt, probs)

        (cache, _, _), (rest, rest_probs) = jax.lax.scan(step, (cache, draft, lengths), keys[1:])
        drafts = jnp.concatenate([draft[:, None], rest.T], axis=1)  # [B, K]
        draft_probs = jnp.concatenate([probs[:, None], jnp.moveaxis(rest_probs, 0, 1)], axis=1)
        return drafts, draft_probs, cache

    def commit(self, params, target, state: KVCache, start, num_accepted, verify_captured):
        # Everything up to the accepted drafts stays valid; later slots are masked by position.
        return state.with_lengths(start + num_accepted + 1)


def self_drafter(target_cfg: ModelConfig, k: int = 4) -> DraftModelDrafter:
    """The target drafting for itself: a diagnostic whose every draft must be accepted."""
    return DraftModelDrafter(cfg=target_cfg, k=k)


def _probe_ids(tokenizer: Any, text: str) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=False)
    # transformers tokenizers return a list; a raw `tokenizers.Tokenizer` an Encoding (no __eq__).
    return list(getattr(encoded, "ids", encoded))


def check_same_tokenizer(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raise when drafter and target tokenize differently (ids would mean different text).

    Accepts transformers tokenizers and raw `tokenizers.Tokenizer` objects."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    probe = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # é 中"
    a = _probe_ids(target_tokenizer, probe)
    b = _probe_ids(draft_tokenizer, probe)
    if a != b or target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            "The draft model's tokenizer differs from the target's, so its token ids mean "
            "different text. Use a draft model trained with the target's tokenizer."
        )

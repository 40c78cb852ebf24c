"""Training an EAGLE-3 head on the frozen target's own continuations, with its multi-step
("training-time test") recipe.

Step 0 runs every pair of a sequence at once: pair t = (target features of token t, token t + 1)
at position t + 1, causal over pairs, and learns token t + 2. Step s > 0 runs every pair again
one position further, fed the true token t + 1 + s and, as hidden input, the drafter's own
output of step s - 1 at the same pair: later draft positions are trained on the drafter's own
features, as at inference. A step-s query sees the step-0 keys of pairs <= t and, of every later
step, only its own pair's key (the keys its inference chain would have). Loss: cross-entropy
over the draft vocabulary, step s weighted by `step_decay ** s`, on answer tokens whose id is in
the draft vocabulary. Params are the drafter's float weights; its vocabulary map (`draft_ids`)
is fixed by the data and lives in the loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.draft_vocab import target_to_draft
from spec_jax.drafters.eagle3 import Eagle3Config, eagle3_head, eagle3_layers, fuse_features
from spec_jax.models.attention import attend
from spec_jax.models.decoder import embed
from spec_jax.models.interface import TargetModel
from spec_jax.training.trainer import TargetModelLoss, cross_entropy


@dataclasses.dataclass(frozen=True)
class Eagle3Loss(TargetModelLoss):
    """loss(params, target_params, batch, key); batch = dict(tokens [B, T], lengths [B],
    prompt_lengths [B], captured [B, T, n*H] target features at the drafter's capture layers)."""

    cfg: Eagle3Config
    target_model: TargetModel  # a built-in ModelConfig is wrapped in Decoder (TargetModelLoss)
    draft_ids: tuple[int, ...]  # target id of draft id i
    ttt_steps: int = 3
    step_decay: float = 0.8

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        cfg = self.cfg
        tokens, lengths, prompt_lengths = batch["tokens"], batch["lengths"], batch["prompt_lengths"]
        b_size, seq_len = tokens.shape
        n_pairs = seq_len - 1
        rows = jnp.arange(b_size)[:, None]
        pairs = jnp.broadcast_to(jnp.arange(n_pairs, dtype=jnp.int32), (b_size, n_pairs))
        causal = pairs[:, :, None] >= pairs[:, None, :]  # [B, T-1, T-1]
        own = jnp.broadcast_to(jnp.eye(n_pairs, dtype=bool), (b_size, n_pairs, n_pairs))
        to_draft = target_to_draft(self.draft_ids, self.target_model.vocab_size)

        hidden = fuse_features(cfg, params, batch["captured"][:, :-1])
        step_keys: list[list[tuple[jax.Array, jax.Array]]] = [[] for _ in params["layers"]]
        total, weight_sum, metrics, leading = 0.0, 0.0, {}, None
        for step in range(self.ttt_steps):
            token_pos = jnp.minimum(pairs + 1 + step, seq_len - 1)  # teacher-forced inputs
            step_tokens = tokens[rows, token_pos]
            token_embeds = (embed(params, step_tokens) if cfg.own_embedding
                            else self.target_model.embed(target_params, step_tokens)).astype(params["fc"].dtype)

            def attend_to_earlier(i, step=step):
                def attend_to(q, k, v):
                    earlier = step_keys[i]
                    parts = [(*earlier[0], causal)] if earlier else []
                    parts += [(*kv, own) for kv in earlier[1:]]
                    parts.append((k, v, causal if not earlier else own))
                    earlier.append((k, v))
                    return attend(q, parts), None
                return attend_to

            out, _ = eagle3_layers(cfg, params, token_embeds, hidden, pairs + 1 + step, attend_to_earlier)
            logits, hidden = eagle3_head(cfg, params, out)  # [B, T-1, Vd]
            label_pos = pairs + 2 + step
            labels = to_draft[tokens[rows, jnp.minimum(label_pos, seq_len - 1)]]
            valid = (label_pos < lengths[:, None]) & (label_pos >= prompt_lengths[:, None]) & (labels >= 0)
            ce = jnp.sum(cross_entropy(logits, jnp.maximum(labels, 0)) * valid) / jnp.maximum(jnp.sum(valid), 1)
            total = total + self.step_decay**step * ce
            weight_sum += self.step_decay**step
            correct = (jnp.argmax(logits, -1) == labels) & valid
            metrics[f"acc_{step}"] = jnp.sum(correct) / jnp.maximum(jnp.sum(valid), 1)
            leading = correct if leading is None else leading & correct
            metrics[f"run_{step}"] = jnp.sum(leading) / jnp.maximum(jnp.sum(valid), 1)
        loss = total / weight_sum
        metrics["ce"] = loss
        metrics["accuracy"] = metrics["acc_0"]
        # Expected accepted drafts per pair under greedy verification (leading correct steps).
        metrics["accept_run"] = sum(metrics[f"run_{s}"] for s in range(self.ttt_steps))
        return loss, metrics

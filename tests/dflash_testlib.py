"""Shared helpers for the DFlash tests: tiny torch targets, reference drafters, a quick fit."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from spec_jax.checkpoints.hf import load_hf_dir
from spec_jax.decoding import loop
from spec_jax.decoding.generate import default_capacity, prompt_bucket
from spec_jax.sampling import SamplingParams

# Tiny models: one thread is fastest, and avoids spinning threads when the 2 cores are shared.
torch.set_num_threads(1)

VOCAB = 128
TARGET_LAYERS = 6
MASK_ID = VOCAB - 1  # never produced by the fitted drafters' training data on purpose


def make_target(kind: str, directory: Path, seed: int = 0):
    """A tiny random HF target saved to `directory`; returns (torch model, spec_jax cfg, params)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(rms_norm_eps=1e-5, rope_theta=10000.0, **common)
        model = transformers.LlamaForCausalLM(config)
    # Larger weights than the default init so greedy continuations are not one repeated token.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.5 / np.sqrt(p.shape[1]))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    cfg, params = load_hf_dir(directory)
    return model, cfg, params


def tiny_targets(tmp_path_factory, prompt_lengths, seq_length: int) -> dict:
    """kind ("qwen3", "llama") -> (torch model, spec_jax Target, prompts, each prompt followed by
    its greedy continuation to `seq_length` tokens). Prompts never hold MASK_ID."""
    from spec_jax.models import Decoder, Target

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, MASK_ID, n).tolist() for n in prompt_lengths]
    out = {}
    for kind in ("qwen3", "llama"):
        model, cfg, params = make_target(kind, tmp_path_factory.mktemp(kind))
        target = Target(jax.tree.map(jnp.asarray, params), Decoder(cfg))
        out[kind] = (model, target, prompts, greedy_sequences(model, prompts, seq_length))
    return out


def greedy_sequences(model, prompts: list[list[int]], total_length: int) -> torch.Tensor:
    """[len(prompts), total_length]: each prompt followed by its greedy continuation."""
    out = []
    with torch.no_grad():
        for p in prompts:
            new = total_length - len(p)
            out.append(model.generate(
                torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )[0])
    return torch.stack(out)


def greedy_choices(model, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """transformers' greedy choice at each position of each continuation, from one forward pass
    over the prompt and the continuation: equal to `continuations` exactly when they are the
    model's greedy tokens (each the argmax after the tokens before it), so plain decoding's tokens
    are checked without a compiled plain loop or a cached `generate` loop per prompt. No attention
    mask: every token is real (generate would take a prompt's 0s, its pad id, for padding)."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, continuations):
            logits = model(torch.tensor([list(p) + list(c)])).logits[0, len(p) - 1 : len(p) + len(c) - 1]
            out.append(logits.argmax(-1).tolist())
    return out


def make_reference_drafter(target_model, *, num_layers, block_size, seed=0, **extra):
    """A random reference `dflash.DFlashDraftModel` for `target_model` (a Qwen3Config + DFlash fields)."""
    import transformers
    from dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    tc = target_model.config
    dflash_config = {"mask_token_id": MASK_ID}
    for name in ("target_layer_ids", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping"):
        if name in extra:
            dflash_config[name] = extra.pop(name)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=tc.hidden_size,
        intermediate_size=extra.pop("intermediate_size", 96),
        num_hidden_layers=num_layers,
        num_attention_heads=extra.pop("num_attention_heads", 4),
        num_key_value_heads=extra.pop("num_key_value_heads", 2),
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        **extra,
    )
    config.block_size = block_size
    config.num_target_layers = tc.num_hidden_layers
    config.dflash_config = dflash_config
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[1]))
    return model


def context_features(target_model, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    with torch.no_grad():
        out = target_model(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def fit_drafter(drafter, target_model, sequences: torch.Tensor, steps: int, lr: float = 3e-3, seed=0):
    """A few hundred Adam steps of the DFlash objective on the target's own continuations:
    context = target features before an anchor, block = [anchor, mask...], labels = what follows."""
    from dflash.model import DFlashDraftModel  # noqa: F401  (the class we train)

    gen = torch.Generator().manual_seed(seed)
    b = drafter.block_size
    feats = context_features(target_model, sequences, drafter.target_layer_ids)
    embed = target_model.get_input_embeddings().weight.detach()
    head = target_model.lm_head
    scale = float(drafter.config.dflash_config.get("input_embedding_scale", 1.0))
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    n, length = sequences.shape
    drafter.train()
    for _ in range(steps):
        anchor = int(torch.randint(4, length - b, (1,), generator=gen))
        rows = torch.randint(0, n, (8,), generator=gen)
        block = torch.full((len(rows), b), MASK_ID)
        block[:, 0] = sequences[rows, anchor]
        labels = sequences[rows, anchor + 1 : anchor + b]
        positions = torch.arange(anchor + b)[None].expand(len(rows), -1)
        out = drafter(
            target_hidden=feats[rows, :anchor],
            noise_embedding=torch.nn.functional.embedding(block, embed) * scale,
            position_ids=positions,
        )
        logits = drafter.compute_logits(out[:, 1:], head)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    return float(loss.detach())


def spec_jax_greedy_steps(target, drafter, params, prompt, max_new):
    """Run the loop step by step (batch 1); -> (generated tokens, accepted+1 per step)."""
    bucket = prompt_bucket(len(prompt))
    capacity = default_capacity(bucket, max_new, drafter.k)
    prompt_tokens = jnp.zeros((1, bucket), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    sampling = SamplingParams.create(0.0)
    stop_ids = jnp.full((loop.MAX_STOP_IDS,), -1, jnp.int32)
    cap = jnp.asarray(max_new, jnp.int32)
    prefill = jax.jit(loop.prefill, static_argnames=("drafter", "capacity"))
    step = jax.jit(loop.speculative_step, static_argnames=("drafter",))
    state = prefill(
        target, drafter, params, prompt_tokens, jnp.array([len(prompt)]), jax.random.key(0),
        sampling, cap, stop_ids, capacity=capacity,
    )
    per_step = []
    while not bool(state.done[0]):
        accepted_before = int(state.stats.accepted[0])
        state = step(state, target, drafter, params, sampling, cap, stop_ids)
        per_step.append(int(state.stats.accepted[0]) - accepted_before + 1)
    generated = np.asarray(state.tokens[0, len(prompt) : int(state.lengths[0])]).tolist()
    return generated, per_step

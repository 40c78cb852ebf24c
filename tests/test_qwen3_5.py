"""Qwen3.5 and Qwen3-Next text (issue 44) as configurations of the one decoder, against
transformers on tiny random checkpoints (float32).

- parity (max |logit diff| <= 1e-4) for a prefill, one-token decode steps and a mixed pass (3 tokens
  of which 2 are committed, then steps) for dense Qwen3.5 and Qwen3-Next (its MoE block, issue
  43's, on the Gated DeltaNet and attention layers alike), the prefill longer than one chunk of
  the gated delta rule;
- the text decoders of a multimodal Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration) and of
  Qwen3.5-MoE load and match;
- the Qwen3.5 decoder passes check_target with its recurrent checks (rollback after a partly
  accepted draft, a tree pass = its branches' chains, a tree commit along the path);
- 64 greedy tokens equal transformers' `generate`, and greedy DFlash tree decoding (the Gated
  DeltaNet states follow the accepted path) equals plain decoding at batch 4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import spec_jax  # noqa: E402
from spec_jax.checkpoints.hf import load_hf_dir  # noqa: E402
from spec_jax.models import Decoder  # noqa: E402
from spec_jax.testing import check_target  # noqa: E402
from tiny_configs import TINY_DFLASH, VOCAB  # noqa: E402

TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def randomised(model, seed: int):
    """Every weight random (norms included: zero-centred ones would hide a missing 1 + w)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.2))
    return model.float().eval()


# The mixture-of-experts block of Qwen3-Next and Qwen3.5-MoE: softmax top-2 of 4 experts,
# renormalised, plus a sigmoid-gated shared expert (spec_jax.models.moe).
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def hf_model(family: str):
    if family == "qwen3_5":
        return randomised(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)), 0)
    if family == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(**TEXT, **EXPERTS)
        return randomised(transformers.Qwen3_5MoeForCausalLM(cfg), 2)
    cfg = transformers.Qwen3NextConfig(**TEXT, **EXPERTS, norm_topk_prob=True)
    return randomised(transformers.Qwen3NextForCausalLM(cfg), 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (the HF model, spec_jax's Decoder, params loaded from its saved checkpoint)."""
    out = {}
    for family in ("qwen3_5", "qwen3_next"):
        model = hf_model(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        cfg, params = load_hf_dir(path)
        assert cfg.architecture == family
        out[family] = (model, Decoder(cfg), jax.tree.map(jnp.asarray, params))
    return out


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def test_prefill_steps_and_a_mixed_pass_match_transformers(checkpoints):
    """Rows of different lengths: a 70-token prefill (the gated delta rule's chunked form: chunks
    of 64; row 1 commits 3 tokens fewer, inside the second chunk), a 3-token pass of which 2 are
    committed, then one-token steps; every pass's logits against one full HF forward."""
    prefill = 70
    tokens = np.random.RandomState(0).randint(0, VOCAB, (2, prefill + 6))
    for family, (model, decoder, params) in checkpoints.items():
        want = hf_logits(model, tokens)
        run, commit = jax.jit(decoder.forward), jax.jit(decoder.commit)  # eager commit: a compile per op
        rows = np.arange(2)

        def check(out, at, what):
            got = np.asarray(decoder.logits(params, out.hidden))
            diff = np.abs(got - want[rows[:, None], at]).max()
            assert diff <= 1e-4, f"{family} {what}: {diff:.2e}"

        positions = jnp.broadcast_to(jnp.arange(prefill), (2, prefill))
        out = run(params, jnp.asarray(tokens[:, :prefill]), positions, decoder.init_cache(2, 80))
        check(out, np.asarray(positions), "prefill")
        start = np.asarray([prefill, prefill - 3])
        cache = commit(out.cache, jnp.asarray(start))
        mixed = start[:, None] + np.arange(3)
        out = run(params, jnp.asarray(tokens[rows[:, None], mixed]), jnp.asarray(mixed), cache)
        check(out, mixed, "mixed pass")
        pos = start + 2
        cache = commit(out.cache, jnp.asarray(pos))
        for _ in range(3):
            out = run(params, jnp.asarray(tokens[rows, pos][:, None]), jnp.asarray(pos[:, None]), cache)
            check(out, pos[:, None], "decode step")
            pos = pos + 1
            cache = commit(out.cache, jnp.asarray(pos))


def test_qwen3_5_decoder_passes_check_target_with_the_recurrent_checks(checkpoints):
    _, decoder, params = checkpoints["qwen3_5"]
    passed = check_target(decoder, params, seq_len=8, capacity=16)
    assert "rollback after a partly accepted draft" in passed and "tree commit" in passed


def test_multimodal_and_moe_qwen3_5_checkpoints_load(tmp_path):
    """Qwen3_5ForConditionalGeneration: `model.language_model.*` is the text decoder, `model.visual.*`
    is skipped; Qwen3_5MoeForCausalLM: the experts on every layer. Their text logits match."""
    cfg = transformers.Qwen3_5Config(
        text_config=TEXT,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )
    tokens = np.random.RandomState(2).randint(0, VOCAB, (1, 6))
    for i, model in enumerate([randomised(transformers.Qwen3_5ForConditionalGeneration(cfg), 2), hf_model("qwen3_5_moe")]):
        model.save_pretrained(tmp_path / str(i))
        loaded, params = load_hf_dir(tmp_path / str(i))
        assert loaded.architecture == "qwen3_5" and loaded.num_layers == 2
        decoder = Decoder(loaded)
        out = decoder.forward(params, jnp.asarray(tokens), jnp.arange(6)[None], decoder.init_cache(1, 8))
        assert np.abs(np.asarray(decoder.logits(params, out.hidden)) - hf_logits(model, tokens)).max() <= 1e-4


def test_greedy_64_tokens_equal_transformers_generate_and_dflash_trees_stay_exact(checkpoints):
    model, decoder, params = checkpoints["qwen3_5"]
    prompt = np.random.RandomState(3).randint(0, VOCAB, 7).tolist()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    assert len(hf) == 64  # the tiny config has no EOS
    prompts = [prompt, prompt[:3], prompt[2:], prompt[:5]]
    common = dict(max_new_tokens=64, capacity=128, ignore_eos=True)
    plain = spec_jax.generate((decoder, params), prompts, **common).generated_ids
    assert plain[0] == hf
    # Random drafts: the rows reject at different depths of the tree in the same step.
    dflash = spec_jax.DFlashDrafter(TINY_DFLASH, tree=16)
    got = spec_jax.generate((decoder, params), prompts, dflash,
                            spec_jax.init_dflash_params(TINY_DFLASH, jax.random.key(5)), **common)
    assert got.generated_ids == plain


def test_a_recurrent_draft_model_is_refused_before_compiling(checkpoints):
    """The draft-model drafter rewinds its own cache to re-feed tokens: a Gated DeltaNet draft
    model is refused by name (a recurrent target takes it as the target)."""
    _, decoder, params = checkpoints["qwen3_5"]
    with pytest.raises(ValueError, match="rewinds its cache"):
        spec_jax.generate((decoder, params), [[1, 2, 3]], spec_jax.DraftModelDrafter(decoder.cfg, k=2), params,
                          max_new_tokens=4)

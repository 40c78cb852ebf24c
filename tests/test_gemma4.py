"""Gemma 4 text as a config of the one decoder: logits, captured layers and 64 greedy tokens equal
transformers', cached steps equal a full pass (check_target), the checkpoint round-trips through
transformers (and its multimodal form loads its text decoder), speculative decoding stays exact
with n-gram and DFlash drafters (chains and trees), and the real-size presets have transformers'
parameter counts.

The tiny model turns every Gemma 4 switch on: 3 layers [sliding, full, full] with a 5-token
window (shorter than the prompts); full layers with their own head size (32 vs 16) and KV heads
(1 vs 2) whose values are the key projection (attention_k_eq_v) and proportional RoPE on half of
each head; per-layer embeddings; the last layer reading layer 1's keys/values (so the cache has
2 layer arrays for 3 layers) with a double-wide MLP; layer scalars, a final soft-cap. Norms, layer scalars and embeddings are perturbed so a swapped or missing one shows.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spec_jax.checkpoints import load_hf_dir, load_target, save_hf_dir  # noqa: E402
from spec_jax.models.weights import untie_embeddings  # noqa: E402
from spec_jax.decoding import generate  # noqa: E402
from spec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_layers, init_dflash_params  # noqa: E402
from spec_jax.drafters.ngram import NGramDrafter  # noqa: E402
from spec_jax.models import Decoder, ModelConfig, forward, init_cache  # noqa: E402
from spec_jax.models.config import ProportionalRope  # noqa: E402
from spec_jax.testing import check_target  # noqa: E402

VOCAB = 128
TOL = 1e-4


def tiny_gemma4_config():
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100_000.0}}
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, num_kv_shared_layers=1, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "full_attention"], final_logit_softcapping=30.0,
        rope_parameters=rope, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(transformers model, checkpoint dir, LoadedModel)."""
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(tiny_gemma4_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif "embed" in name:  # peakier logits: fewer near-ties in the greedy comparisons
                p.mul_(4.0)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(()).item())
    path = tmp_path_factory.mktemp("gemma4") / "tiny"
    model.save_pretrained(path, safe_serialization=True)
    return model, path, load_target(str(path))


def _hf_greedy(model, prompt, new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_config_maps_every_switch(gemma4):
    cfg = gemma4[2].cfg
    assert cfg.architecture == "gemma4" and cfg.layer_windows[0] == 5
    assert (cfg.global_head_dim, cfg.num_global_kv_heads, cfg.attention_k_eq_v) == (32, 1, True)
    assert cfg.rope_scaling == ProportionalRope(0.5) and cfg.sliding_rope_theta == 1_000.0
    assert (cfg.num_kv_shared_layers, cfg.double_wide_mlp, cfg.per_layer_input_size) == (1, True, 8)
    assert [cfg.kv_source(i) for i in range(3)] == [0, 1, 1]
    assert cfg.kv_cache_shapes == ((2, 16), (1, 32))  # only layers 0 and 1 keep a cache
    layers = gemma4[2].params["layers"]
    assert "wv" not in layers[1] and "wk" not in layers[2] and layers[2]["w_up"].shape == (64, 192)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    # Sharded, each cache array splits its own KV heads: 2 over model=2, the global layer's 1 not.
    from jax.sharding import AbstractMesh, PartitionSpec

    from spec_jax.sharding.rules import state_shardings

    cache = jax.eval_shape(lambda: init_cache(cfg, 4, 32))
    shardings = state_shardings(cache, AbstractMesh((2, 2), ("data", "model")))
    assert [s.spec for s in shardings.k] == [PartitionSpec("data", "model"), PartitionSpec("data")]


def test_logits_and_captured_layers_match_transformers(gemma4):
    model, _, loaded = gemma4
    cfg = loaded.cfg
    tokens = np.random.RandomState(0).randint(0, VOCAB, (2, 14))  # longer than the window
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    positions = jnp.broadcast_to(jnp.arange(14), (2, 14))
    capture = (0, 1)  # HF's last hidden_states entry (the KV-shared layer's) is after the final norm
    logits, captured, cache = forward(loaded.params, cfg, jnp.asarray(tokens), positions,
                                      init_cache(cfg, 2, 32), capture)
    assert len(cache.k) == 2
    diff = float(np.abs(np.asarray(logits) - out.logits.numpy()).max())
    assert diff <= TOL, diff
    for i, layer_id in enumerate(capture):  # HF hidden_states[id + 1] is the output of layer `id`
        np.testing.assert_allclose(np.asarray(captured)[..., i * 64:(i + 1) * 64],
                                   out.hidden_states[layer_id + 1].numpy(), atol=TOL)


def test_greedy_64_tokens_equal_transformers_generate(gemma4):
    model, _, loaded = gemma4
    prompt = [int(t) for t in np.random.RandomState(1).randint(3, VOCAB, 9)]
    ours = generate(loaded, [prompt], max_new_tokens=64, ignore_eos=True)
    assert ours.generated_ids[0] == _hf_greedy(model, prompt, 64)


def test_builtin_decoder_passes_check_target(gemma4):
    """Prefill + one-token steps equal one full forward (rows of different lengths, past the
    window), rollback by length, a tree pass and commit: with 2 cache arrays for 3 layers."""
    passed = check_target(Decoder(gemma4[2].cfg), gemma4[2].params, seq_len=12)
    assert "tree commit" in passed and "positions honoured" in passed, passed


def test_save_roundtrip_loads_in_transformers(gemma4, tmp_path):
    model, path, loaded = gemma4
    cfg, params = load_hf_dir(path)
    out = save_hf_dir(tmp_path / "resaved", cfg, params)
    reloaded = transformers.Gemma4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.tensor(np.random.RandomState(2).randint(0, VOCAB, (1, 11)))
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy(), atol=TOL)
    cfg2, params2 = load_hf_dir(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multimodal_checkpoint_loads_its_text_decoder(gemma4, tmp_path):
    """A Gemma4ForConditionalGeneration dir as transformers writes it (`model.language_model.*`,
    the text config nested, the token ids outside it) loads as the same text decoder; the
    KV-shared layers' k/v projections some checkpoints carry are skipped, as transformers does."""
    from safetensors.numpy import load_file, save_file

    model, _, loaded = gemma4
    multimodal = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=tiny_gemma4_config(), vision_config=None, audio_config=None))
    multimodal.model.language_model.load_state_dict(model.model.state_dict())
    multimodal.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"] and "text_config" in config
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.language_model.layers.2.self_attn.k_proj.weight"] = np.ones((32, 64), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg, params = untie_embeddings(*load_hf_dir(tmp_path))  # as `load_target` loads on CPU
    assert cfg == loaded.cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refused_configs_name_the_reason():
    base = tiny_gemma4_config().to_dict()
    with pytest.raises(ValueError, match="needs num_experts, top_k_experts, moe_intermediate_size"):
        ModelConfig.from_hf_config({**base, "enable_moe_block": True})  # the MoE variant without its shape
    for rope_type in ("linear", "yarn"):  # yarn stays gpt-oss's alone
        with pytest.raises(ValueError, match=f"rope_type '{rope_type}'"):
            ModelConfig.from_hf_config({**base, "rope_parameters": {
                "full_attention": {"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    # The families refused before stay refused, each with its reason.
    gemma2 = {**base, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
    with pytest.raises(ValueError, match="Unsupported architecture"):
        ModelConfig.from_hf_config(gemma2)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_config({**base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                    "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        ModelConfig.from_hf_config({**base, "num_kv_shared_layers": 3})


# (drafter, tree budget, batch): a chain and a tree (each its own compiled loop), batch 1 and 4.
SPEC_CASES = [("ngram", 6, 4), ("dflash", 0, 1)]
PROMPTS = {
    1: [[5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 14]],
    4: [[5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9], [33, 7], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71],
        [8, 8, 8, 8, 8]],
}


def test_greedy_speculative_equals_transformers(gemma4):
    """Greedy n-gram and DFlash output (chains and trees, batch 1 and 4) equals transformers'
    greedy tokens: the verify pass, the tree commit and rollback move only the 2 cache arrays,
    and the KV-shared layers read them right."""
    model, _, loaded = gemma4
    new = 20
    for kind, tree, batch in SPEC_CASES:
        if kind == "ngram":
            drafter, params = NGramDrafter(k=3), None
        else:
            dcfg = DFlashConfig(layer=dflash_layers(1, 64, 4, 2, 16, 96, vocab_size=VOCAB), block_size=4,
                                target_layer_ids=(1, 2), mask_token_id=VOCAB - 1, num_target_layers=3)
            drafter, params = DFlashDrafter(dcfg), init_dflash_params(dcfg, jax.random.key(7), scale=3.0)
        spec = generate(loaded, PROMPTS[batch], drafter, params, max_new_tokens=new, ignore_eos=True, tree=tree)
        expected = [_hf_greedy(model, p, new) for p in PROMPTS[batch]]
        assert spec.generated_ids == expected, (kind, tree, batch)


# Parameters (billions) of each preset and without the per-layer-embedding table: the published
# "effective" sizes (E2B 2.3B).
PRESET_SIZES = {"gemma-4-e2b": (4.63, 2.28), "gemma-4-e4b": (7.46, 4.64), "gemma-4-31b": (30.70, 30.70)}


def test_real_size_presets_have_the_models_shapes():
    """Parameter counts from eval_shape (nothing allocated); E2B's (KV sharing, double-wide MLPs,
    per-layer embeddings) equals transformers' Gemma4ForCausalLM of its config on the meta device,
    and its forward traces with a cache of 15 layer arrays for 35 layers."""
    from spec_jax.models.decoder import init_params
    from spec_jax.models.presets import preset_config

    for preset, (billions, without_ple) in PRESET_SIZES.items():
        cfg = preset_config(preset, "bfloat16")
        shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
        count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
        ple = int(np.prod(shapes["per_layer_embed"].shape)) if "per_layer_embed" in shapes else 0
        assert abs(count / 1e9 - billions) < 0.01 and abs((count - ple) / 1e9 - without_ple) < 0.01, (preset, count)
    cfg = preset_config("gemma-4-e2b", "bfloat16")
    shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
    hf = {k: v for k, v in cfg.to_hf_config().items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        reference = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**hf))
    scalars = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("layer_scalar"))
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == (
        sum(p.numel() for p in reference.parameters()) + scalars)
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 64))
    assert len(cache.k) == 15
    logits = jax.eval_shape(
        lambda p, c: forward(p, cfg, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), c)[0],
        shapes, cache)
    assert logits.shape == (1, 4, cfg.vocab_size)

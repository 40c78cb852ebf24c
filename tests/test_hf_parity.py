"""spec_jax logits equal transformers' for tiny random Llama / Qwen3 checkpoints saved to disk."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spec_jax.checkpoints import load_hf_dir, load_target, save_hf_dir  # noqa: E402
from spec_jax.models import forward, init_cache  # noqa: E402
from spec_jax.models.decoder import commit  # noqa: E402

VOCAB = 97
SEQ = 12
TOL = 1e-4  # fp32 on both sides; measured max diff is ~1e-6


def _common(**extra):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(extra)
    return kw


CASES = {
    "llama_tied_gqa": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_common(tie_word_embeddings=True))
    ),
    "llama_untied_llama3_rope": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **_common(
                tie_word_embeddings=False,
                head_dim=24,
                rope_theta=50000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            )
        )
    ),
    "qwen3_sliding": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            **_common(
                tie_word_embeddings=False,
                head_dim=16,
                layer_types=["full_attention", "sliding_attention", "full_attention"],
                sliding_window=4,
                use_sliding_window=True,
            )
        )
    ),
    "qwen3_tied": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**_common(tie_word_embeddings=True, head_dim=32))
    ),
}


def _random_model(name):
    torch.manual_seed(0)
    model = CASES[name]().eval()
    # Non-trivial norms so a swapped or missing norm shows up in the logits.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _tokens(batch=2):
    return np.random.RandomState(0).randint(0, VOCAB, (batch, SEQ))


def _hf_forward(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def _ours(params, cfg, tokens, capture=()):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, captured, _ = forward(params, cfg, jnp.asarray(tokens), positions, init_cache(cfg, b, 32), capture)
    return np.asarray(logits), None if captured is None else np.asarray(captured)


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    model = _random_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, model, path


def test_logits_and_hidden_states_match(saved):
    name, model, path = saved
    loaded = load_target(str(path))  # on CPU a tied head is untied: the parity below covers that
    cfg = loaded.cfg
    assert cfg.architecture == ("qwen3" if name.startswith("qwen3") else "llama")
    published = load_target(str(path), untie_head=False).cfg
    assert published.tie_embeddings == model.config.tie_word_embeddings and not cfg.tie_embeddings
    tokens = _tokens()
    ref_logits, ref_hidden = _hf_forward(model, tokens)
    capture = (0, cfg.num_layers - 2)
    logits, captured = _ours(loaded.params, cfg, tokens, capture)
    assert np.abs(logits - ref_logits).max() < TOL
    h = cfg.hidden_size
    for i, layer_id in enumerate(capture):
        # HF hidden_states[0] is the embedding; [id + 1] is the output of layer `id`.
        np.testing.assert_allclose(captured[..., i * h : (i + 1) * h], ref_hidden[layer_id + 1], atol=TOL)


def test_prefill_then_decode_equals_full_forward(saved):
    _, _, path = saved
    cfg, params = load_hf_dir(path)
    tokens = _tokens()
    full, _ = _ours(params, cfg, tokens)
    b = tokens.shape[0]
    cache = init_cache(cfg, b, 32)
    prefix = SEQ - 1
    pos = jnp.broadcast_to(jnp.arange(SEQ), (b, SEQ))
    pre_logits, _, cache = forward(params, cfg, jnp.asarray(tokens[:, :prefix]), pos[:, :prefix], cache)
    cache = commit(cache, jnp.full((b,), prefix))
    step_logits, _, cache = forward(params, cfg, jnp.asarray(tokens[:, prefix:]), pos[:, prefix:], cache)
    cache = commit(cache, jnp.full((b,), SEQ))
    np.testing.assert_allclose(np.asarray(pre_logits), full[:, :prefix], atol=TOL)
    np.testing.assert_allclose(np.asarray(step_logits), full[:, prefix:], atol=TOL)
    assert np.asarray(cache.lengths).tolist() == [SEQ] * b


def test_save_roundtrip_loads_in_transformers(saved, tmp_path):
    name, model, path = saved
    cfg, params = load_hf_dir(path)
    out = save_hf_dir(tmp_path / "resaved", cfg, params)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    cls = type(model)
    reloaded = cls.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens()
    ref_logits, _ = _hf_forward(model, tokens)
    new_logits, _ = _hf_forward(reloaded, tokens)
    np.testing.assert_allclose(new_logits, ref_logits, atol=TOL)
    # And spec_jax reads its own output back to the same params.
    cfg2, params2 = load_hf_dir(out)
    assert cfg2 == cfg
    for a, b in zip(_leaves(params), _leaves(params2)):
        np.testing.assert_array_equal(a, b)


def test_save_refuses_to_overwrite_unless_asked(saved, tmp_path):
    _, _, path = saved
    cfg, params = load_hf_dir(path)
    target = tmp_path / "ckpt"
    save_hf_dir(target, cfg, params)
    with pytest.raises(ValueError, match="overwrite=True"):
        save_hf_dir(target, cfg, params)
    save_hf_dir(target, cfg, params, overwrite=True)
    assert load_hf_dir(target)[0] == cfg


def test_sharded_index(tmp_path):
    model = _random_model("llama_untied_llama3_rope")
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    loaded = load_target(str(tmp_path))
    tokens = _tokens()
    logits, _ = _ours(loaded.params, loaded.cfg, tokens)
    np.testing.assert_allclose(logits, _hf_forward(model, tokens)[0], atol=TOL)


def test_bfloat16_load(saved):
    _, _, path = saved
    loaded = load_target(str(path), dtype="bfloat16")
    assert loaded.cfg.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in _leaves(loaded.params))


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]

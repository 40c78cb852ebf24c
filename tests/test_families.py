"""Gemma 3, Qwen2 and Mistral as configs of the one decoder: logits and greedy decoding equal
transformers', cached steps equal a full pass (check_target), every drafter kind stays exact, the
names/configs round-trip, and the real-size presets have the right shapes (eval_shape only).

Tiny random HF models (hidden 64, 2 layers, vocab 128) with windows of 5 tokens, shorter than
the prompts and the generations; norms and biases perturbed so a swapped or missing one shows.
Two layers keep every compiled loop cheap and still mix a sliding and a full layer (Gemma 3, Qwen2).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

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
from spec_jax.drafters.draft_model import DraftModelDrafter  # noqa: E402
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params  # noqa: E402
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, init_medusa_params  # noqa: E402
from spec_jax.drafters.ngram import NGramDrafter  # noqa: E402
from spec_jax.models import Decoder, ModelConfig, forward, init_cache  # noqa: E402
from spec_jax.models.config import GLOBAL_WINDOW, LinearRopeScaling  # noqa: E402
from spec_jax.testing import check_target  # noqa: E402

VOCAB = 128
WINDOW = 5
TOL = 1e-4


def _common(**extra):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2)
    kw.update(extra)
    return kw


def _gemma3():
    # Mixed sliding/full layers, each type its own RoPE (linear scaling on the full layers), and
    # a query_pre_attn_scalar that is not head_dim.
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}}
    cfg = transformers.Gemma3TextConfig(**_common(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, rope_parameters=rope,
        layer_types=["sliding_attention", "full_attention"]))
    return transformers.Gemma3ForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(**_common(use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1, tie_word_embeddings=False))
    return transformers.Qwen2ForCausalLM(cfg)


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_common(sliding_window=WINDOW, head_dim=24)))


def _qwen3_moe():
    # Layer 0 dense (mlp_only_layers, and decoder_sparse_step 2), layer 1 top-3 of 8 experts, weights
    # not renormalised (Mixtral renormalises). test_moe.py checks the layer choice on more layers.
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**_common(
        head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=False)))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**_common(
        head_dim=16, sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2)))


def _gpt_oss():
    # Attention sinks, q/k/v/o biases, a sliding then a full layer, YaRN RoPE, and top-2 of 4
    # clamped-SwiGLU experts with biases (a limit of 0.5 clamps a good share of the activations).
    yarn = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(**_common(
        head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, swiglu_limit=0.5,
        attention_bias=True, rope_parameters=yarn)))


HF_MODELS = {"gemma3": _gemma3, "qwen2": _qwen2, "mistral": _mistral}
HF_MODELS.update(qwen3_moe=_qwen3_moe, mixtral=_mixtral)  # mixture-of-experts (spec_jax.models.moe)
HF_MODELS.update(gpt_oss=_gpt_oss)
FAMILIES = sorted(HF_MODELS)


def build_family_models(root: Path, families: tuple[str, ...] | None = None) -> dict:
    """family -> (transformers model, checkpoint dir under `root`, LoadedModel), for `families`
    (default all)."""
    out = {}
    for name, make in HF_MODELS.items():
        if families is not None and name not in families:
            continue
        torch.manual_seed(0)
        model = make().eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname or "bias" in pname:
                    p.add_(0.3 * torch.randn_like(p))
                elif pname.endswith("gate.weight") and "proj" not in pname:  # MoE routers: decisive routing
                    p.mul_(10.0)
                elif "embed" in pname:  # peakier logits: fewer near-ties in the greedy comparison
                    p.mul_(4.0)
        path = root / name
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (model, path, load_target(str(path)))
    return out


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    return build_family_models(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def compiled_checks(family_models):
    """The compile-heavy checks, run once for the tests that assert on them: check_target per
    family and every speculative case. (They ran in a worker process while only workers had the
    cheap codegen; conftest gives this process the same flags, so a worker would only import
    everything and build the family models again.)"""
    return {
        "check_target": {name: run_check_target(loaded) for name, (_, _, loaded) in family_models.items()},
        "speculative": {case_id(*case): run_speculative_case(family_models, *case) for case in SPEC_CASES},
    }


def _hf_forward(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_captured_layers_match_transformers(family_models, family):
    model, _, loaded = family_models[family]
    cfg = loaded.cfg
    assert cfg.architecture == family
    expected_windows = {"gemma3": (WINDOW, GLOBAL_WINDOW), "qwen2": (GLOBAL_WINDOW, WINDOW),
                        "mistral": (WINDOW, WINDOW), "qwen3_moe": (GLOBAL_WINDOW,) * 2,
                        "mixtral": (WINDOW, WINDOW), "gpt_oss": (WINDOW, GLOBAL_WINDOW)}[family]
    assert cfg.layer_windows == expected_windows
    if family == "gemma3":
        assert cfg.rope_scaling == LinearRopeScaling(4.0) and cfg.sliding_rope_theta == 1000.0
    tokens = np.random.RandomState(0).randint(0, VOCAB, (2, 14))  # longer than the window
    ref_logits, ref_hidden = _hf_forward(model, tokens)
    positions = jnp.broadcast_to(jnp.arange(14), (2, 14))
    capture = (0,)  # HF's last hidden_states entry is after the final norm
    logits, captured, _ = forward(loaded.params, cfg, jnp.asarray(tokens), positions, init_cache(cfg, 2, 32), capture)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=TOL)
    h = cfg.hidden_size
    for i, layer_id in enumerate(capture):  # HF hidden_states[id + 1] is the output of layer `id`
        np.testing.assert_allclose(np.asarray(captured)[..., i * h:(i + 1) * h], ref_hidden[layer_id + 1], atol=TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_64_tokens_equal_transformers_generate(family_models, family):
    model, _, loaded = family_models[family]
    prompt = [int(t) for t in np.random.RandomState(1).randint(3, VOCAB, 9)]
    ours = generate(loaded, [prompt], max_new_tokens=64, ignore_eos=True)
    assert ours.generated_ids[0] == _hf_greedy(model, prompt, 64)


def run_check_target(loaded) -> list[str]:
    return check_target(Decoder(loaded.cfg), loaded.params, seq_len=12)


@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_decoder_passes_check_target(compiled_checks, family):
    """check_target(Decoder(cfg), params): prefill + one-token steps equal one full forward (rows
    of different lengths, past the window), rollback by length, a tree pass and commit."""
    passed = compiled_checks["check_target"][family]
    assert "tree commit" in passed and "positions honoured" in passed, passed


@pytest.mark.parametrize("family", FAMILIES)
def test_save_roundtrip_loads_in_transformers(family_models, family, tmp_path):
    model, path, loaded = family_models[family]
    cfg, params = load_hf_dir(path)
    out = save_hf_dir(tmp_path / "resaved", cfg, params)
    reloaded = type(model).from_pretrained(out, dtype=torch.float32).eval()
    tokens = np.random.RandomState(2).randint(0, VOCAB, (1, 11))
    np.testing.assert_allclose(_hf_forward(reloaded, tokens)[0], _hf_forward(model, tokens)[0], atol=TOL)
    cfg2, params2 = load_hf_dir(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gemma3_multimodal_checkpoint_loads_its_text_decoder(family_models, tmp_path):
    """A Gemma3ForConditionalGeneration dir (hub names `language_model.model.*`, a vision tower,
    the text config nested and partly left to its defaults) loads as the text decoder alone."""
    from safetensors.numpy import load_file, save_file

    model, path, loaded = family_models["gemma3"]
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {("language_model." + n): v for n, v in tensors.items()}
    renamed["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    renamed["multi_modal_projector.mm_input_projection_weight"] = np.ones((8, 64), np.float32)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    text = json.loads((path / "config.json").read_text())
    for name in ("architectures", "bos_token_id", "eos_token_id", "rms_norm_eps"):  # left to defaults
        text.pop(name, None)
    text["max_position_embeddings"] = 256
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
              "eos_token_id": [2, 106]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg, params = untie_embeddings(*load_hf_dir(tmp_path))  # as `load_target` loads on CPU
    assert cfg.eos_token_ids == (2, 106) and cfg.bos_token_id == 2 and cfg.rms_norm_eps == 1e-6
    assert cfg.replace(eos_token_ids=loaded.cfg.eos_token_ids, bos_token_id=1) == loaded.cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_family_config_errors_are_clear(tmp_path):
    base = _common(head_dim=16)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_config({"architectures": ["Gemma3ForCausalLM"], **base, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="Unsupported architecture"):
        ModelConfig.from_hf_config({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **base})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_hf_config({"architectures": ["Qwen2ForCausalLM"], **base,
                                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # Qwen2 ignores layer_types / max_window_layers unless use_sliding_window is set, as HF does.
    qwen2 = ModelConfig.from_hf_config({"architectures": ["Qwen2ForCausalLM"], **base, "sliding_window": 4,
                                        "max_window_layers": 1, "use_sliding_window": False})
    assert qwen2.layer_windows == (GLOBAL_WINDOW,) * 2 and qwen2.qkv_bias
    # Gemma 3 files of transformers < 5: rope_theta + rope_scaling (global), rope_local_base_freq.
    old = ModelConfig.from_hf_config({"architectures": ["Gemma3ForCausalLM"], **base, "sliding_window_pattern": 2,
                                      "rope_theta": 5e5, "rope_local_base_freq": 2e3,
                                      "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert old.layer_windows == (4096, GLOBAL_WINDOW)
    assert (old.rope_theta, old.rope_scaling, old.sliding_rope_theta) == (5e5, LinearRopeScaling(8.0), 2e3)
    assert ModelConfig.from_hf_config(old.to_hf_config()) == old


# ----------------------------------------------------------------------------- drafters
NEW = 24
PROMPTS = {
    1: [[5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 14]],
    4: [[5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9], [33, 7], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73],
        [8, 8, 8, 8, 8]],
}
# (family, drafter, batch). Every case is a compiled loop of its own (the suite's time), so the
# cases are chosen to cover each path once: Gemma 3 and Qwen2 meet every model drafter that reads
# more than the final hidden state (the draft model of their family, DFlash, EAGLE-3: what reaches
# embed, logits and captured layers), each at batch 1 on one and batch 4 on the other; Mistral
# (a window shorter than the generation) DFlash and EAGLE-3. n-gram lookup reaches the model only
# through the verify pass the others exercise, Medusa only through the final hidden state: one
# family each. The MoE families' cases are test_moe.py's (MOE_SPEC_CASES). The reference is
# transformers' greedy generate per prompt (our AR loop equals it:
# test_greedy_64_tokens_equal_transformers_generate), which costs no compile.
SPEC_CASES = [
    ("gemma3", "draft", 4), ("gemma3", "dflash", 1), ("gemma3", "eagle3", 4), ("gemma3", "medusa", 1),
    ("qwen2", "ngram", 4), ("qwen2", "draft", 1), ("qwen2", "dflash", 4), ("qwen2", "eagle3", 1),
    ("mistral", "dflash", 1), ("mistral", "eagle3", 4),
]


def _drafter(kind, cfg: ModelConfig, target_params):
    """A drafter of `kind` attached to the target `cfg` (random weights, except the draft model:
    the target's own family and weights plus noise, so it accepts some drafts)."""
    key = jax.random.key(7)
    if kind == "ngram":
        return NGramDrafter(k=3), None
    if kind == "draft":  # under jit: one compile, not eager ops per weight shape
        noisy = jax.jit(lambda params: jax.tree_util.tree_map(
            lambda x: x + 0.1 * jnp.std(x) * jax.random.normal(key, x.shape, x.dtype), params))(target_params)
        return DraftModelDrafter(cfg, k=3), noisy
    if kind in ("dflash", "dflash_tree"):  # dflash_tree: a best-first tree of 16 nodes
        dcfg = DFlashConfig(layer=dflash_layers(1, cfg.hidden_size, 4, 2, 16, 96, vocab_size=VOCAB),
                            block_size=4, target_layer_ids=(0, 1), mask_token_id=VOCAB - 1,
                            num_target_layers=cfg.num_layers)
        return DFlashDrafter(dcfg, tree=16 if kind == "dflash_tree" else 0), init_dflash_params(dcfg, key, scale=3.0)
    if kind == "medusa":
        mcfg = MedusaConfig.for_target(cfg, num_heads=3)
        return MedusaDrafter(mcfg, k=3), init_medusa_params(mcfg, key, scale=3.0)
    layer = ModelConfig(vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=96, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=16)
    ecfg = Eagle3Config(layer=layer, draft_vocab_size=VOCAB, aux_layer_ids=(1, 2), own_embedding=False,
                        num_target_layers=cfg.num_layers)
    return Eagle3Drafter(ecfg, k=3), init_eagle3_params(ecfg, key, scale=3.0)


def _hf_greedy(model, prompt, new):
    return list(_hf_greedy_once(model, tuple(prompt), new))


@functools.cache  # the cases share a family's prompts: each reference generation runs once
def _hf_greedy_once(model, prompt: tuple[int, ...], new: int) -> tuple[int, ...]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def case_id(family: str, kind: str, batch: int) -> str:
    return f"{family}-{kind}-b{batch}"


def run_speculative_case(models, family, kind, batch) -> dict:
    """Greedy speculative tokens vs transformers' greedy tokens for one case."""
    model, _, loaded = models[family]
    drafter, params = _drafter(kind, loaded.cfg, loaded.params)
    spec = generate(loaded, PROMPTS[batch], drafter, params, max_new_tokens=NEW, ignore_eos=True)
    return {"ours": spec.generated_ids, "transformers": [_hf_greedy(model, p, NEW) for p in PROMPTS[batch]],
            "accepted": int(spec.stats.accepted)}


@pytest.mark.parametrize("family,kind,batch", SPEC_CASES, ids=[case_id(*c) for c in SPEC_CASES])
def test_greedy_speculative_equals_ar(compiled_checks, family, kind, batch):
    result = compiled_checks["speculative"][case_id(family, kind, batch)]
    assert result["ours"] == result["transformers"]
    if kind == "draft":  # the noisy copy of the target agrees with it on some drafts
        assert result["accepted"] > 0


def test_target_embed_and_logits_apply_the_family_scaling(family_models):
    """Drafters reach the target only through embed/logits: Gemma's embed is scaled by
    sqrt(hidden) (rounded to the model dtype) and logits are soft-capped when configured."""
    _, _, loaded = family_models["gemma3"]
    model, params = Decoder(loaded.cfg), loaded.params
    tokens = jnp.asarray([[3, 4]])
    table = params["embed"][tokens]
    np.testing.assert_allclose(np.asarray(model.embed(params, tokens)), np.asarray(table * jnp.float32(8.0)), rtol=1e-6)
    hidden = jax.random.normal(jax.random.key(0), (1, 2, 64)) * 30
    capped = Decoder(loaded.cfg.replace(final_logit_softcapping=5.0))
    raw = np.asarray(model.logits(params, hidden))
    np.testing.assert_allclose(np.asarray(capped.logits(params, hidden)), 5.0 * np.tanh(raw / 5.0), rtol=1e-5)
    assert np.abs(np.asarray(capped.logits(params, hidden))).max() <= 5.0


# ----------------------------------------------------------------------------- presets
@pytest.mark.parametrize("preset,billions", [("gemma-3-1b", 1.0), ("gemma-3-27b", 27.0),
                                             ("qwen2.5-7b", 7.6), ("mistral-7b", 7.2)])
def test_real_size_presets_have_the_models_shapes(preset, billions):
    """Parameter counts of the real models, from eval_shape (nothing is allocated)."""
    from spec_jax.models.decoder import init_params
    from spec_jax.models.presets import preset_config

    cfg = preset_config(preset, "bfloat16")
    shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert abs(count / 1e9 - billions) / billions < 0.04, count
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 64))
    logits = jax.eval_shape(
        lambda p, c: forward(p, cfg, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), c)[0],
        shapes, cache)
    assert logits.shape == (1, 4, cfg.vocab_size)


@pytest.mark.parametrize("preset", ["gemma-3-27b", "qwen2.5-7b"])
def test_sharding_rules_cover_the_new_weights(preset):
    """Biases split over the model axis with their heads; Gemma's extra norms are replicated
    (a data=2 x model=4 mesh, shapes only: no devices needed)."""
    import types

    from jax.sharding import PartitionSpec

    from spec_jax.models.presets import preset_config
    from spec_jax.models.weights import is_spec, model_weight_specs
    from spec_jax.sharding.rules import DEFAULT_RULES, logical_to_partition_spec

    mesh = types.SimpleNamespace(shape={"data": 2, "model": 4})
    specs = model_weight_specs(preset_config(preset))
    layer = {name: logical_to_partition_spec(s.shape, s.axes, mesh, DEFAULT_RULES)
             for name, s in specs["layers"][0].items()}
    assert layer["wq"] == PartitionSpec(None, "model") and layer["w_up"] == PartitionSpec(None, "model")
    if preset == "qwen2.5-7b":  # 28 query heads, 4 KV heads: both divide model=4
        assert layer["bq"] == layer["bk"] == layer["bv"] == PartitionSpec("model")
    else:
        assert layer["post_attn_norm"] == layer["post_mlp_norm"] == PartitionSpec()
    for s in jax.tree_util.tree_leaves(specs, is_leaf=is_spec):  # every logical axis is known
        logical_to_partition_spec(s.shape, s.axes, mesh, DEFAULT_RULES)

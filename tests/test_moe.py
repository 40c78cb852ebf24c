"""The mixture-of-experts block (spec_jax.models.moe) and its families.

Parity, greedy decoding, check_target and save round trips on Qwen3-MoE, Mixtral and gpt-oss run
with the other families in tests/test_families.py (its HF_MODELS); sharded == unsharded with
experts over the mesh in tests/test_sharding.py (the "moe" model). Here: the expert computations
agree, routing is per token, greedy speculative decoding on the three MoE families equals plain
decoding (MOE_SPEC_CASES), fused expert checkpoints, Qwen2-MoE's shared expert, which layers get
experts, the configs, and the real-size presets (eval_shape only).
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.models import ModelConfig, forward, init_cache, init_params
from spec_jax.models import moe as moe_module
from spec_jax.models.config import MoeConfig
from spec_jax.models.presets import preset_config
from spec_jax.models.weights import init_from_specs, model_weight_specs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

H = 64


def _moe_layer_params(moe: MoeConfig, key) -> dict:
    cfg = ModelConfig(vocab_size=32, hidden_size=H, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, moe=moe)
    lp = init_from_specs(model_weight_specs(cfg), key)["layers"][0]
    # Nonzero biases and a decisive router, so a wrong path or a swapped expert shows.
    return {name: (value + 0.1 * jax.random.normal(jax.random.fold_in(key, i), value.shape)
                   if "_b_" in name or name == "router_bias" else value * (4.0 if name == "router" else 1.0))
            for i, (name, value) in enumerate(sorted(lp.items()))}


def test_expert_paths_agree():
    """The per-pair loop, the gathered pairs, every expert (dense) and ragged_dot give one result,
    with expert and router biases, a gated shared expert, and both router scorings."""
    x = jax.random.normal(jax.random.key(1), (2, 5, H))
    for moe in (MoeConfig(8, 3, 32, normalize_top_k=True, shared_expert_intermediate_size=48, shared_expert_gate=True),
                MoeConfig(8, 2, 32, router_scoring="topk_softmax", router_bias=True, expert_bias=True)):
        lp = _moe_layer_params(moe, jax.random.key(0))
        paths = (moe_module.LOOP, moe_module.GATHER, moe_module.DENSE, moe_module.RAGGED)
        outs = jax.jit(lambda lp, x, moe=moe: [moe_module.moe_block(lp, x, moe, path) for path in paths])(lp, x)
        for path, out in zip(paths, outs):
            np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), atol=1e-5, err_msg=path)
    assert moe_module.expert_path(8, 128, "cpu") == moe_module.LOOP
    assert moe_module.expert_path(8, 128, "gpu") == moe_module.GATHER
    assert moe_module.expert_path(512, 128, "gpu") == moe_module.DENSE
    assert moe_module.expert_path(512, 128, "tpu") == moe_module.RAGGED


def test_routing_is_per_token(monkeypatch):
    """A token is routed to the same experts, and its logits agree within 1e-5, whether its pass
    holds 64, 8 or 1 tokens and whatever the other rows hold (no capacity, no dropping)."""
    cfg = ModelConfig(vocab_size=97, hidden_size=H, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, architecture="qwen3_moe",
                      moe=MoeConfig(8, 2, 32, normalize_top_k=True))
    params = init_params(cfg, jax.random.key(0))
    params["layers"] = [{**lp, "router": lp["router"] * 4.0} for lp in params["layers"]]
    routed: list[np.ndarray] = []  # each MoE call's experts [B * T, k], in layer order
    original = moe_module.route

    def recording_route(lp, x, moe):
        weights, experts = original(lp, x, moe)
        jax.debug.callback(lambda e: routed.append(np.asarray(e)), experts, ordered=True)
        return weights, experts

    monkeypatch.setattr(moe_module, "route", recording_route)
    rng = np.random.RandomState(0)
    target = rng.randint(0, 97, 64)

    def run(rows, cache, start):
        """One pass of `rows` [B, T] at positions start..; -> (logits [B, T, V], per-layer
        experts [B, T, k] of this pass, cache with the pass committed)."""
        rows = jnp.asarray(rows)
        b, t = rows.shape
        del routed[:]
        positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))
        logits, _, cache = jax.jit(forward, static_argnums=1)(params, cfg, rows, positions, cache)
        jax.effects_barrier()
        experts = [e.reshape(b, t, -1) for e in routed]
        return np.asarray(logits), experts, cache.with_lengths(cache.lengths + t)

    def stack(row0, other):
        return np.stack([row0, other])

    # 64 tokens in one pass, next to one other row.
    logits_64, experts_64, _ = run(stack(target, rng.randint(0, 97, 64)), init_cache(cfg, 2, 64), 0)
    # The last 8 after a prefill, next to a different row.
    other = rng.randint(0, 97, 64)
    _, _, cache = run(stack(target[:56], other[:56]), init_cache(cfg, 2, 64), 0)
    logits_8, experts_8, cache = run(stack(target[56:], other[56:]), cache, 56)
    # The last one in a pass of its own (7 of the 8 committed), next to a third row's token.
    logits_1, experts_1, _ = run(stack(target[63:], [5]), cache.with_lengths(cache.lengths - 1), 63)

    assert len(experts_64) == len(experts_8) == len(experts_1) == 2  # both layers route
    for layer in range(2):
        np.testing.assert_array_equal(experts_8[layer][0], experts_64[layer][0, 56:])
        np.testing.assert_array_equal(experts_1[layer][0], experts_64[layer][0, 63:])
    assert len({tuple(e) for e in experts_64[1][0]}) > 4  # the tokens do take different experts
    np.testing.assert_allclose(logits_8[0], logits_64[0, 56:], atol=1e-5)
    np.testing.assert_allclose(logits_1[0], logits_64[0, 63:], atol=1e-5)


# (family, drafter kind, batch). Each case is a compiled loop of its own (9-14 CPU s on this 2-core
# machine), so the suite runs a covering set of six: each MoE family at batch 1 and 4, and every
# drafter kind on one (n-gram; the family itself as a draft model, whose cache rolls back through
# its experts; DFlash as a chain and as a tree of 16; EAGLE-3). SPEC_JAX_MOE_MATRIX=full runs every
# kind on every family at both batch sizes (30 loops; benchmarks/RESULTS.md, Issue 43, records it).
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
MOE_KINDS = ("ngram", "draft", "dflash", "dflash_tree", "eagle3")
MOE_SPEC_CASES = [
    ("qwen3_moe", "dflash_tree", 1), ("qwen3_moe", "eagle3", 4),
    ("mixtral", "ngram", 1), ("mixtral", "draft", 4),
    ("gpt_oss", "dflash", 1), ("gpt_oss", "dflash_tree", 4),
]


def moe_spec_cases() -> list[tuple[str, str, int]]:
    if os.environ.get("SPEC_JAX_MOE_MATRIX") == "full":
        return [(family, kind, batch) for family in MOE_FAMILIES for kind in MOE_KINDS for batch in (1, 4)]
    return MOE_SPEC_CASES


@pytest.mark.slow  # a loop per drafter and family (about 40 s): the full suite
def test_greedy_speculation_on_moe_targets_equals_plain_decoding(tmp_path):
    """Greedy speculative tokens == transformers' greedy tokens (which our plain decoding equals:
    test_families' 64-token test) on the tiny random Qwen3-MoE, Mixtral and gpt-oss of
    test_families, for each case of `moe_spec_cases`; the draft model accepts some drafts."""
    import test_families as tf
    from spec_jax.decoding import generate

    models = tf.build_family_models(tmp_path, MOE_FAMILIES)
    reference, wrong = {}, []
    for family, kind, batch in moe_spec_cases():
        model, _, loaded = models[family]
        if (family, batch) not in reference:  # no compile: transformers' generate
            reference[family, batch] = [tf._hf_greedy(model, p, tf.NEW) for p in tf.PROMPTS[batch]]
        drafter, params = tf._drafter(kind, loaded.cfg, loaded.params)
        out = generate(loaded, tf.PROMPTS[batch], drafter, params, max_new_tokens=tf.NEW, ignore_eos=True)
        if out.generated_ids != reference[family, batch] or (kind == "draft" and not int(out.stats.accepted)):
            wrong.append((family, kind, batch, int(out.stats.accepted)))
    assert not wrong, wrong


def test_qwen2_moe_shared_expert_matches_transformers(tmp_path):
    """Qwen2-MoE: q/k/v biases, top-2 of 8 experts and the sigmoid-gated shared expert; the saved
    checkpoint loads back in transformers."""
    from spec_jax.checkpoints import load_hf_dir, save_hf_dir

    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, max_position_embeddings=256)
    model = transformers.Qwen2MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                p.mul_(10.0)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf_dir(tmp_path / "hf")
    assert cfg.architecture == "qwen2_moe" and cfg.qkv_bias
    assert cfg.moe == MoeConfig(8, 2, 32, shared_expert_intermediate_size=48, shared_expert_gate=True)
    tokens = np.random.RandomState(0).randint(0, 128, (2, 9))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    logits, _, _ = forward(params, cfg, jnp.asarray(tokens), positions, init_cache(cfg, 2, 16))
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4)
    reloaded = type(model).from_pretrained(save_hf_dir(tmp_path / "ours", cfg, params)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor(tokens)).logits.numpy(), expected, atol=1e-5)
    model.save_pretrained(tmp_path / "fused", save_original_format=False)  # 3-D experts, shared expert as is
    _assert_same_params(load_hf_dir(tmp_path / "fused"), (cfg, params))


def test_gemma4_moe_matches_transformers_and_speculates_exactly(tmp_path):
    """Gemma 4's MoE variant (26B-A4B's block: experts beside the dense MLP, the router on its own
    norm of the residual with learned input and per-expert scales, GeGLU experts, three more norms)
    on a tiny random checkpoint transformers saves (2 layers, sliding window 5 < the prompts, k_eq_v
    full layer): logits, 64 greedy tokens, greedy n-gram speculation at batch 2, and the checkpoint
    spec_jax saves loads back in transformers; with SPEC_JAX_MOE_MATRIX=full also check_target and
    n-gram at batch 1 (16 CPU s more: the suite leaves them to the dense Gemma 4's check_target and
    the MoE families' per-token routing test; benchmarks/RESULTS.md, Issue 43, records the run)."""
    import test_families as tf
    from spec_jax.checkpoints import load_target, save_hf_dir
    from spec_jax.drafters.ngram import NGramDrafter
    from spec_jax.testing import check_target

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e5}}
    hf_cfg = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0, rope_parameters=rope,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # perturb the norms and scales (a swapped one shows), a decisive router
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.add_(0.3 * torch.randn_like(p))
            elif "embed" in name or "router.proj" in name:
                p.mul_(4.0)
    model.save_pretrained(tmp_path / "hf")
    loaded = load_target(str(tmp_path / "hf"))
    cfg = loaded.cfg
    assert cfg.architecture == "gemma4" and cfg.moe.beside_dense_mlp and cfg.moe.router_input_norm
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    assert {"w_up", "experts_w_up", "router_expert_scale", "experts_out_norm"} <= set(loaded.params["layers"][1])

    tokens = np.random.RandomState(0).randint(0, 128, (2, 14))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    positions = jnp.broadcast_to(jnp.arange(14), (2, 14))
    logits, _, _ = forward(loaded.params, cfg, jnp.asarray(tokens), positions, init_cache(cfg, 2, 32))
    diff = float(np.abs(np.asarray(logits) - expected).max())
    assert diff <= 1e-4, diff

    prompt, other = tf.PROMPTS[1][0], [33, 7]
    reference = tf._hf_greedy(model, prompt, 64)  # greedy: its first NEW tokens are NEW tokens' answer
    assert tf.generate(loaded, [prompt], max_new_tokens=64, ignore_eos=True).generated_ids[0] == reference
    full = os.environ.get("SPEC_JAX_MOE_MATRIX") == "full"
    if full:
        passed = check_target(tf.Decoder(cfg), loaded.params, seq_len=12)
        assert "tree commit" in passed and "positions honoured" in passed, passed
    expected_rows = [reference[:tf.NEW], tf._hf_greedy(model, other, tf.NEW)]
    for batch in (1, 2) if full else (2,):
        spec = tf.generate(loaded, [prompt, other][:batch], NGramDrafter(k=3), None, max_new_tokens=tf.NEW,
                           ignore_eos=True)
        assert spec.generated_ids == expected_rows[:batch], batch
        assert int(spec.stats.accepted) > 0  # the repeating prompt: n-gram drafts get accepted

    reloaded = transformers.Gemma4ForCausalLM.from_pretrained(
        save_hf_dir(tmp_path / "ours", cfg, loaded.params), dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor(tokens)).logits.numpy(), expected, atol=1e-5)


def _assert_same_params(a, b):
    assert a[0] == b[0]
    for x, y in zip(jax.tree_util.tree_leaves(a[1]), jax.tree_util.tree_leaves(b[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fused_expert_checkpoints_load_and_match_transformers(tmp_path):
    """transformers 5's fused experts (`save_pretrained(save_original_format=False)`: Qwen3-MoE's and
    Mixtral's `mlp.experts.gate_up_proj` [E, 2F, H] and `down_proj` [E, H, F], Mixtral's router as
    `mlp.gate`; gpt-oss's [E, H, 2F] gate/up interleaved either way) load to the params of the
    per-expert checkpoint, give transformers' logits, and save per expert (which transformers and
    we read back); Qwen2-MoE's (test above), Qwen3.5-MoE's and Qwen3-Next's load to the per-expert
    params too. A fused tensor whose shape does not fit the config is named with both shapes."""
    from safetensors.numpy import load_file, save_file

    import test_families as tf
    from spec_jax.checkpoints import CheckpointError, load_hf_dir, save_hf_dir

    tokens = np.random.RandomState(0).randint(0, tf.VOCAB, (2, 14))  # test_families' logits shapes
    positions = jnp.broadcast_to(jnp.arange(14), (2, 14))
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):
        torch.manual_seed(0)
        model = tf.HF_MODELS[family]().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "router.weight")):
                    p.mul_(10.0)  # decisive routing
            expected = model(torch.tensor(tokens)).logits.numpy()
        fused, split = tmp_path / family / "fused", tmp_path / family / "split"
        model.save_pretrained(fused, save_original_format=False)
        model.save_pretrained(split)
        assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(fused / "model.safetensors")
        cfg, params = load_hf_dir(fused)
        _assert_same_params((cfg, params), load_hf_dir(split))
        if family != "gpt_oss":  # its files are fused either way: test_families' parity covers them
            logits, _, _ = forward(params, cfg, jnp.asarray(tokens), positions, init_cache(cfg, 2, 32), (0,))
            np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4)
        resaved = save_hf_dir(tmp_path / family / "resaved", cfg, params)
        _assert_same_params(load_hf_dir(resaved), (cfg, params))
        with torch.no_grad():
            reloaded = type(model).from_pretrained(resaved).eval()
            np.testing.assert_allclose(reloaded(torch.tensor(tokens)).logits.numpy(), expected, atol=1e-5)

    import test_qwen3_5  # Qwen3.5-MoE and Qwen3-Next (hybrid recurrent): the same fused names

    for family in ("qwen3_5_moe", "qwen3_next"):
        model = test_qwen3_5.hf_model(family)
        model.save_pretrained(tmp_path / family / "fused", save_original_format=False)
        model.save_pretrained(tmp_path / family / "split")
        _assert_same_params(load_hf_dir(tmp_path / family / "fused"), load_hf_dir(tmp_path / family / "split"))

    # Qwen3-MoE's layer 1: 8 experts of width 32 over hidden 64. Too few experts, then gate rows only.
    tensors = load_file(tmp_path / "qwen3_moe" / "fused" / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    for bad, shape in ((tensors[name][:4], "(4, 64, 64)"), (tensors[name][:, :32], "(8, 32, 64)")):
        save_file({**tensors, name: np.ascontiguousarray(bad)}, tmp_path / "qwen3_moe" / "fused" / "model.safetensors")
        message = f"gate_up_proj: config implies (8, 64, 64), file has {shape}"
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_hf_dir(tmp_path / "qwen3_moe" / "fused")


def test_which_layers_have_experts_and_config_round_trip():
    """decoder_sparse_step and mlp_only_layers pick the same layers as transformers builds; the
    presets' configs round-trip through config.json; bad MoE fields are clear errors."""
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=7, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
        decoder_sparse_step=2, mlp_only_layers=[3])
    model = transformers.Qwen3MoeForCausalLM(hf_cfg)
    has_experts = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert has_experts == [False, True, False, False, False, True, False]
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    assert [cfg.moe.is_moe_layer(i) for i in range(7)] == has_experts
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):
        preset = preset_config(name)
        assert ModelConfig.from_hf_config(preset.to_hf_config()) == preset
    windowed = preset_config("mixtral-8x7b").replace(
        layer_types=("sliding_attention",) * 32, sliding_window=4096)
    assert ModelConfig.from_hf_config(windowed.to_hf_config()) == windowed
    base = hf_cfg.to_dict()
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and num_experts=4"):
        ModelConfig.from_hf_config({**base, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf_config({**base, "mlp_only_layers": [7]})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_config({**base, "hidden_act": "gelu"})


@pytest.mark.parametrize("preset,total,active", [("qwen3-30b-a3b", 30.5, 3.35), ("mixtral-8x7b", 46.7, 12.9),
                                                 ("gemma-4-26b-a4b", 25.23, 3.82)])
def test_moe_presets_have_the_models_shapes(preset, total, active):
    """Total and active parameter counts of the real models (eval_shape: nothing is allocated)."""
    cfg = preset_config(preset, "bfloat16")
    shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    counts = moe_module.param_counts(cfg)
    assert counts["total"] == count and abs(count / 1e9 - total) / total < 0.01, count
    assert abs(counts["active"] / 1e9 - active) / active < 0.01, counts
    assert shapes["layers"][0]["experts_w_gate"].shape == (cfg.moe.num_experts, cfg.hidden_size,
                                                           cfg.moe.expert_intermediate_size)
    if preset == "qwen3-30b-a3b":  # the forward traces at these shapes too
        logits = jax.eval_shape(
            lambda p, c: forward(p, cfg, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), c)[0],
            shapes, jax.eval_shape(lambda: init_cache(cfg, 1, 64)))
        assert logits.shape == (1, 4, cfg.vocab_size)
    # A verify pass of T tokens reads the union of their experts: k for one token, towards all E.
    reads = [moe_module.param_counts(cfg, t)["read"] for t in (1, 4, 16, 64)]
    assert reads[0] == counts["active"] and reads == sorted(reads) and reads[-1] < counts["total"]


def test_info_and_roofline_count_the_routed_experts(capsys):
    """`spec-jax info` on a random 30B MoE preset (shapes only, nothing allocated): total and
    active parameters, the bytes a decode step reads; the roofline's floor reads the same."""
    from spec_jax.app.main import main
    from spec_jax.app.roofline import weight_bytes_read

    assert main(["info", "--target", "random:qwen3-30b-a3b", "--dtype", "bfloat16", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["target"]
    assert info["params"] == 30_532_122_624 and info["active_params_per_token"] == 3_353_032_704
    assert info["weight_bytes_per_step"] == 2 * info["active_params_per_token"]
    cfg = preset_config("qwen3-30b-a3b", "bfloat16")
    assert weight_bytes_read(cfg, 2 * info["params"], 1) == pytest.approx(info["weight_bytes_per_step"])
    assert weight_bytes_read(preset_config("qwen3-8b"), 1000, 16) == 1000  # dense: every weight


def test_a_drafter_named_for_a_moe_target_takes_the_measured_k():
    """Without a K, a drafter on a MoE target runs at most the measured table's K for the backend
    (CPU: 3, a chain; a backend with no MoE curve measured: the drafter's own); a K the caller
    names wins, and a dense target keeps the drafter's own K. No compile."""
    from spec_jax.checkpoints import LoadedModel
    from spec_jax.checkpoints.shipped import load_drafter, moe_target_choice

    cfg = ModelConfig(vocab_size=32, hidden_size=H, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, moe=MoeConfig(8, 2, 32))
    moe_target, dense_target = (LoadedModel(c, None, None, None, "test") for c in (cfg, cfg.replace(moe=None)))
    assert moe_target_choice("cpu")[:2] == (3, 0) and moe_target_choice("gpu")[:2] == (None, 0)
    assert jax.default_backend() == "cpu"
    for kind in ("ngram", "self"):  # their own K: 4
        assert load_drafter(kind, moe_target)[0].k == 3
        assert load_drafter(kind, moe_target, k=6)[0].k == 6
        assert load_drafter(kind, dense_target)[0].k == 4

"""Architecture presets, random-weight targets and `spec-jax bench --roofline` (on a tiny preset)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.app import roofline
from spec_jax.checkpoints import CheckpointError, load_target
from spec_jax.app.main import main
from spec_jax.models.presets import PRESETS, preset_config
from spec_jax.models.weights import count_params, model_weight_specs


@pytest.mark.parametrize(
    "name, params",
    [
        # The parameter counts the model cards publish: the presets have the real shapes.
        ("smollm2-135m", 134_515_008),
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3.1-8b", 8_030_261_248),
        ("qwen3-8b", 8_190_735_360),
    ],
)
def test_preset_parameter_counts(name, params):
    assert count_params(model_weight_specs(PRESETS[name])) == params


def test_smollm2_preset_matches_the_default_model(default_model_installed):
    real = load_target(None, untie_head=False).cfg  # the checkpoint as published
    preset = preset_config("smollm2-135m", real.dtype)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "tie_embeddings", "qk_norm", "rms_norm_eps"):
        assert getattr(preset, field) == getattr(real, field), field


def test_random_target_shapes_and_dtype():
    target = load_target("random:tiny", dtype="bfloat16", untie_head=False)
    assert target.cfg == preset_config("tiny", "bfloat16")
    assert target.tokenizer is None and target.source == "random:tiny"
    leaves = jax.tree.leaves(target.params)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    assert sum(x.size for x in leaves) == count_params(model_weight_specs(target.cfg))
    assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in leaves)


def test_a_tied_head_gets_its_own_transposed_copy_on_cpu():
    """On CPU `load_target` unties a tied LM head (XLA:CPU multiplies a few rows by the [V, H]
    embedding on a slow path): the same model, the same tokens, plain and speculative."""
    from spec_jax import NGramDrafter, generate

    tied = load_target("random:tiny", untie_head=False)
    untied = load_target("random:tiny")  # untie_head=None: on CPU, untie
    assert jax.default_backend() == "cpu"
    assert tied.cfg.tie_embeddings and "lm_head" not in tied.params
    assert untied.cfg == tied.cfg.replace(tie_embeddings=False)
    np.testing.assert_array_equal(np.asarray(untied.params["lm_head"]), np.asarray(tied.params["embed"]).T)
    assert sum(x.size for x in jax.tree.leaves(untied.params)) == count_params(model_weight_specs(untied.cfg))
    ids = [[5, 9, 5, 9, 5, 9, 7], [3, 4, 3, 4, 3, 4, 3]]
    plain = generate(tied, ids, max_new_tokens=12, ignore_eos=True).generated_ids
    assert generate(untied, ids, max_new_tokens=12, ignore_eos=True).generated_ids == plain
    drafted = generate(untied, ids, NGramDrafter(k=3), None, max_new_tokens=12, ignore_eos=True)
    assert drafted.generated_ids == plain
    assert load_target("random:tiny", untie_head=True).cfg == untied.cfg  # forced (any backend)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(CheckpointError, match="llama-3.2-1b"):
        load_target("random:llama-9000")


def test_verify_costs_count_their_compiles():
    """Each T's verify pass is a program of its own, counted in spec_jax's compile tally (the quick
    GPU suite's verify_cost step reports from it how many compiled and how many the cache served)."""
    from spec_jax.decoding.programs import compile_tally

    target = load_target("random:tiny")
    before = compile_tally().programs
    seconds = roofline.verify_costs(target, batch=1, context=8, capacity=32, verify_tokens=[1, 3], repeats=1)
    assert set(seconds) == {1, 3} and all(s > 0 for s in seconds.values())
    assert compile_tally().programs == before + 2


def test_roofline_report_is_consistent(tmp_path):
    target = load_target("random:tiny")
    report = roofline.run_roofline(
        target, batch=2, context=20, verify_tokens=[4, 2], new_tokens=4, repeats=2,
        copy_bytes=8 << 20, progress=False,
    )
    weight_bytes = 4 * count_params(model_weight_specs(target.cfg))
    assert report["weight_bytes"] == weight_bytes
    assert report["copy"]["buffer_bytes"] == 8 << 20
    bandwidth = report["copy"]["bytes_per_s"]
    assert bandwidth > 0
    # The step reads its (untied, on CPU) head whole and gathers rows of the input embedding.
    read = weight_bytes - target.params["embed"].nbytes
    assert not target.cfg.tie_embeddings and report["step_weight_bytes"] == read
    assert report["floor_ms"] == pytest.approx(1e3 * read / bandwidth)
    assert report["floor_with_cache_ms"] > report["floor_ms"]
    # T = 1 is always measured: it is the unit of the relative costs.
    assert [r["tokens"] for r in report["verify"]] == [1, 2, 4]
    first = report["verify"][0]
    assert first["relative"] == 1.0 and first["ms"] == report["forward_1_token_ms"]
    for row in report["verify"]:
        assert row["ms"] > 0
        assert row["ms_per_token"] == pytest.approx(row["ms"] / row["tokens"])
        assert row["relative"] == pytest.approx(row["ms"] / first["ms"])
    # The loop step is a difference of two timings (prefill + 4 steps minus prefill + 1 step):
    # for this tiny model it is within timing noise, so only its consistency is checked.
    assert np.isfinite(report["ar_loop_step_ms"])
    assert report["ar_step_over_floor"] == pytest.approx(report["ar_loop_step_ms"] / report["floor_ms"])
    paths = roofline.write_roofline(report, tmp_path)
    assert json.loads(paths[0].read_text())["verify"] == report["verify"]
    assert paths[1].stat().st_size > 10_000  # a real PNG


def test_cli_roofline_json(capsys):
    code = main(["bench", "--roofline", "--target", "random:tiny", "--context", "16",
                 "--verify-tokens", "1,3", "--max-new-tokens", "3", "--no-progress", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    auto_dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    assert report["kind"] == "roofline" and report["dtype"] == auto_dtype
    assert [r["tokens"] for r in report["verify"]] == [1, 3]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--verify-tokens", "1,x"], "--verify-tokens"),
        (["--verify-tokens", "0,4"], ">= 1"),
        (["--mesh", "data=1,model=1"], "one device"),
        (["--target", "random:nope"], "Unknown model preset"),
    ],
)
def test_cli_roofline_usage_errors(capsys, argv, message):
    code = main(["bench", "--roofline", "--target", "random:tiny", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_shipped_drafters_load_in_the_target_dtype(default_model_installed):
    import dataclasses

    from spec_jax.app.inputs import DrafterSpec, build_drafter
    from spec_jax.checkpoints.shipped import SHIPPED_DRAFTERS

    real = load_target(None)
    target = dataclasses.replace(real, cfg=real.cfg.replace(dtype="bfloat16"))
    for kind in SHIPPED_DRAFTERS:  # stored as int8, dequantized to the target's dtype
        _, params = build_drafter(DrafterSpec(kind), target)
        # Every weight in bfloat16; a reduced draft vocabulary's map (d2t) stays int32.
        floats = {x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)}
        ints = {x.dtype for x in jax.tree.leaves(params) if not jnp.issubdtype(x.dtype, jnp.floating)}
        assert floats == {jnp.dtype(jnp.bfloat16)} and ints <= {jnp.dtype(jnp.int32)}, kind


def test_bfloat16_generate_runs_every_drafter_kind(capsys):
    for drafter in ("none", "ngram", "self"):
        code = main(["generate", "--target", "random:tiny", "--dtype", "bfloat16", "--drafter", drafter,
                     "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-new-tokens", "12", "--ignore-eos", "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        (row,) = json.loads(out)["results"]
        assert len(row["generated_ids"]) == 12 and all(0 <= t < 512 for t in row["generated_ids"])

"""Meshes, partition rules and sharded generation.

Rule and mesh checks run here on abstract meshes (no devices needed). The sharded `generate`
checks need 8 devices, which this pytest process cannot have (jax started with 1 CPU device), so
`tests/sharding_worker.py` runs them in a fresh process with 8 fake CPU devices and prints JSON.

By default every mesh (2x4, 4x2, 1x8), every drafter and both tiny models (heads that divide the
model axis, and SmolLM2-like 9 / 3 heads that do not) are covered by a spread of cases, each one
compile of the loop; SPEC_JAX_FULL_SHARDING=1 runs every drafter on every mesh.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models.config import ModelConfig
from spec_jax.models.weights import model_weight_specs
from spec_jax.sharding import (
    ShardingRules,
    default_mesh_shape,
    drafter_weight_specs,
    initialize_distributed,
    is_main_process,
    kv_cache_shardings,
    make_mesh,
    param_shardings,
    parse_mesh_spec,
)

WORKER = Path(__file__).with_name("sharding_worker.py")

# SmolLM2-135M's shapes (specs only: nothing is allocated).
SMOLLM2 = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, tie_embeddings=True,
)
DIVISIBLE = SMOLLM2.replace(num_heads=8, num_kv_heads=4, head_dim=72)


def abstract_mesh(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), ("data", "model"))


# ----------------------------------------------------------------------------- meshes
def test_parse_mesh_spec():
    assert parse_mesh_spec("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh_spec(" model = 8 ") == {"data": 1, "model": 8}
    assert parse_mesh_spec({"data": 4}) == {"data": 4, "model": 1}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("data=2,tensor=4", "Unknown mesh axis 'tensor'"),
        ("data=2,data=4", "given twice"),
        ("data=two", "not an integer"),
        ("data=0,model=1", "positive integer"),
        ("data2", "axis=size"),
        ("", "Empty mesh spec"),
    ],
)
def test_parse_mesh_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh_spec(spec)


def test_make_mesh_checks_device_count():
    n = jax.device_count()
    with pytest.raises(ValueError, match=f"needs {8 * n} devices but {n} are available"):
        make_mesh(f"data=2,model={4 * n}")
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "model") and mesh.size == n


def test_default_mesh_shape():
    assert default_mesh_shape(8) == {"data": 1, "model": 8}
    assert default_mesh_shape(4, DIVISIBLE) == {"data": 1, "model": 4}
    # 9 / 3 heads do not split over 4 devices: data parallel instead.
    assert default_mesh_shape(4, SMOLLM2) == {"data": 4, "model": 1}
    assert default_mesh_shape(3, SMOLLM2) == {"data": 1, "model": 3}


# ----------------------------------------------------------------------------- rules
def test_param_shardings_divisible():
    shardings = param_shardings(model_weight_specs(DIVISIBLE), abstract_mesh(2, 4))
    assert len(shardings["layers"]) == DIVISIBLE.num_layers
    for layers in shardings["layers"]:
        assert layers["wq"].spec == P(None, "model")
        assert layers["wk"].spec == P(None, "model")
        assert layers["wo"].spec == P("model")
        assert layers["w_gate"].spec == P(None, "model")
        assert layers["w_down"].spec == P("model")
        assert layers["attn_norm"].spec == P()
    assert shardings["embed"].spec == P("model")
    assert shardings["final_norm"].spec == P()


def test_param_shardings_replicate_non_dividing_heads_with_one_note(caplog):
    mesh = abstract_mesh(2, 4)
    with caplog.at_level(logging.INFO, logger="spec_jax.sharding"):
        shardings = param_shardings(model_weight_specs(SMOLLM2), mesh)
        param_shardings(model_weight_specs(SMOLLM2), mesh)  # same model and mesh: no new note
    for layers in shardings["layers"]:
        for name in ("wq", "wk", "wv", "wo"):
            assert layers[name].spec == P(), name
        assert layers["w_up"].spec == P(None, "model")  # 1536 MLP divides
    assert shardings["embed"].spec == P("model")  # 49152 vocab divides
    notes = [r for r in caplog.records if "do not divide" in r.getMessage()]
    assert len(notes) == 1
    message = notes[0].getMessage()
    assert "['layers'][0]['wq']" in message and "q_heads=9" in message and "kv_heads=3" in message
    assert "w_up" not in message


def test_gemma4_weights_and_its_assistants_follow_the_rules(caplog):
    """Gemma 4's own weights (per-layer embeddings, k_eq_v full layers with their own head size and
    KV heads, KV-shared layers without wk/wv) and its assistant's get rules like every other
    weight: the per-layer table splits by vocabulary, and the KV heads a mesh does not divide are
    replicated and named in the one note."""
    from spec_jax.drafters.gemma4_assistant import assistant_config_for_target, assistant_weight_specs
    from tiny_configs import TINY_GEMMA4

    mesh = abstract_mesh(2, 4)
    with caplog.at_level(logging.INFO, logger="spec_jax.sharding"):
        target = param_shardings(model_weight_specs(TINY_GEMMA4), mesh)
    assert target["per_layer_embed"].spec == P("model") and target["embed"].spec == P("model")
    assert target["layers"][1]["wq"].spec == P(None, "model") and "wv" not in target["layers"][1]  # k_eq_v
    assert "wk" not in target["layers"][2] and target["layers"][2]["w_up"].spec == P(None, "model")  # shared KV
    note = next(r.getMessage() for r in caplog.records if "do not divide" in r.getMessage())
    assert "['layers'][0]['wk'] (64, 2, 16): dim 1 (kv_heads=2) over model=4" in note
    assert "['layers'][1]['wk'] (64, 1, 32): dim 1 (kv_heads=1) over model=4" in note
    assistant = param_shardings(assistant_weight_specs(assistant_config_for_target(TINY_GEMMA4, 32)), mesh)
    assert assistant["layers"][1]["wq"].spec == P(None, "model") and assistant["embed"].spec == P("model")


def test_rules_are_data():
    rules = ShardingRules(mlp=None, vocab=None)
    shardings = param_shardings(model_weight_specs(DIVISIBLE), abstract_mesh(1, 8), rules)
    assert shardings["layers"][0]["w_up"].spec == P()
    assert shardings["embed"].spec == P()
    assert shardings["layers"][0]["wq"].spec == P(None, "model")
    with pytest.raises(ValueError, match="Unknown logical axis 'heads'"):
        ShardingRules().mesh_axis("heads")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rules.mlp = "model"  # type: ignore[misc]


def test_kv_cache_shardings():
    cache = kv_cache_shardings(abstract_mesh(2, 4), batch=4, num_kv_heads=4, num_layers=3)
    assert len(cache.k) == len(cache.v) == 3
    assert all(k.spec == P("data", "model") for k in cache.k + cache.v)
    assert cache.lengths.spec == P("data")
    odd = kv_cache_shardings(abstract_mesh(2, 4), batch=3, num_kv_heads=3)
    assert odd.k[0].spec == P() and odd.lengths.spec == P()


def test_drafter_weight_specs():
    assert drafter_weight_specs(None) is None
    assert drafter_weight_specs(NGramDrafter(k=2)) is None
    draft_cfg = DIVISIBLE.replace(num_layers=1)
    specs = drafter_weight_specs(DraftModelDrafter(draft_cfg, k=2))
    assert specs == model_weight_specs(draft_cfg)


def test_distributed_single_process(monkeypatch):
    for var in ("SPEC_JAX_COORDINATOR", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert initialize_distributed() is False
    assert is_main_process()
    with pytest.raises(ValueError, match="needs num_processes and process_id"):
        initialize_distributed(coordinator_address="10.0.0.1:1234")


# ----------------------------------------------------------------------------- sharded generate
DRAFTERS = ["ar", "ngram", "draft_model", "dflash", "dflash_vocab", "eagle3", "table", "gemma4_mtp", "qwen_mtp"]
MESHES = ["2x4", "4x2", "1x8"]


# Default: each model meets every mesh and, between the two models, every drafter.
DEFAULT_CASES = {
    # ngram+adaptive: the adaptive depth (rows over data, the depth batch-wide; n-gram at a fixed
    # K is the other models' case)
    "divisible": ["ar@1x8", "ngram+adaptive@4x2", "dflash_vocab@2x4", "table@2x4", "eagle3@4x2"],
    "nondivisible": ["draft_model@2x4", "ngram@1x8", "dflash@4x2", "eagle3@2x4"],
    "moe": ["ngram@1x8",  # one expert per device
            "gemma4_mtp@2x4",  # the tiny Gemma 4 (its own target) with its assistant reading the sharded cache
            "qwen_mtp@4x2"],  # a recurrent (Gated DeltaNet) target with its MTP head
}


def worker_cases(model: str) -> list[str]:
    if os.environ.get("SPEC_JAX_FULL_SHARDING"):
        return [f"{d}@{m}" for d in DRAFTERS for m in MESHES]
    return DEFAULT_CASES[model]


@pytest.fixture(scope="module")
def worker_results() -> dict:
    """Run both models' workers at once (each is one process with 8 fake devices)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(WORKER.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    procs = {
        model: subprocess.Popen(
            [sys.executable, str(WORKER), model, ",".join(worker_cases(model))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for model in ("divisible", "nondivisible", "moe")
    }
    results = {}
    for model, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{model} worker failed:\n{stderr[-4000:]}"
        results[model] = json.loads(stdout.strip().splitlines()[-1])
        results[model]["stderr"] = stderr
    return results


@pytest.mark.parametrize("model", ["divisible", "nondivisible", "moe"])
def test_sharded_generate_matches_unsharded(worker_results, model):
    result = worker_results[model]
    assert result["devices"] == 8
    assert sorted(result["cases"]) == sorted(worker_cases(model))
    for name, case in result["cases"].items():
        # Token-identical to the unsharded greedy AR baseline.
        assert case["equal"], name
        assert case["guarded_equal"], name
        # One compiled while loop, no host callbacks / infeed / outfeed / send / recv in it,
        # and it ran with implicit transfers disallowed.
        assert case["has_while"], name
        assert case["host_ops"] == [], (name, case["host_ops"])
        # The KV caches inside the compiled loop are no bigger per device than the rule says.
        assert case["cache_within_rule"], (name, case["cache_per_device"], case["cache_types_in_hlo"])
        # Drafter weights follow their own WeightSpec trees (same head counts as the target).
        drafter_name, mesh_name = name.split("@")
        if drafter_name.endswith("+adaptive"):  # drafts accepted, then K = 0 steps (issue 41)
            assert case["depths"] == [0, 3] and case["accepted"] > 0, (name, case)
        if drafter_name in ("draft_model", "dflash", "dflash_vocab", "eagle3"):
            assert case["drafter_wq_spec"] == EXPECTED_SHARDS[(model, mesh_name)][0], name
        if drafter_name == "gemma4_mtp":  # the assistant's 4 query heads split where they divide
            assert case["drafter_wq_spec"] == ("P(None, 'model')" if 4 % int(mesh_name.split("x")[1]) == 0
                                               else "P()"), name
        if drafter_name == "qwen_mtp":  # the MTP layer's 8 query heads ([query, gate] each) split
            assert case["drafter_wq_spec"] == "P(None, 'model')", name
        if drafter_name == "table":
            # A drafter the library has never heard of: its own weight_specs() split its
            # [vocab, vocab] table over `model`, and its drafts were accepted.
            model_parts = int(mesh_name.split("x")[1])
            assert case["drafter_table_spec"] == "P('model',)", name
            assert case["drafter_table_shard_rows"] == 128 // model_parts, name
            assert case["accepted"] > 0, name


def test_sharded_dflash_is_covered(worker_results):
    names = [n for r in worker_results.values() for n in r["cases"]]
    assert any(n.startswith("dflash@") for n in names)
    assert any(n.startswith("dflash_vocab@") for n in names)  # a reduced draft vocabulary too
    assert any(n.startswith("eagle3@") for n in names)
    assert any(n.startswith("table@") for n in names)
    assert any(n.startswith("gemma4_mtp@") for n in names)  # a drafter reading the target's cache
    assert any(n.startswith("qwen_mtp@") for n in names)  # a recurrent target


def test_a_drafter_defined_in_a_test_shows_in_info():
    """The drafter protocol alone puts a new drafter into `spec-jax info` (no library change)."""
    from spec_jax.app.info import drafter_info
    from table_drafter import TableDrafter

    info = drafter_info(TableDrafter(vocab=128, k=3))
    assert info == {"kind": "TableDrafter", "k": 3, "params": 128 * 128, "capture_layers": [],
                    "kv_bytes_per_token": 0}


# Expected (wq spec, cache spec) per model and mesh.
EXPECTED_SHARDS = {
    ("divisible", "2x4"): ("P(None, 'model')", "P('data', 'model')"),
    ("divisible", "4x2"): ("P(None, 'model')", "P('data', 'model')"),
    # 4 KV heads do not split 8 ways: the cache and wk/wv stay whole, wq (8 heads) splits.
    ("divisible", "1x8"): ("P(None, 'model')", "P()"),
    ("nondivisible", "2x4"): ("P()", "P('data',)"),
    ("nondivisible", "4x2"): ("P()", "P('data',)"),
    ("nondivisible", "1x8"): ("P()", "P()"),
}
EXPECTED_SHARDS.update({("moe", mesh): EXPECTED_SHARDS[("divisible", mesh)] for mesh in MESHES})


def test_experts_are_sharded_over_model(worker_results):
    """The MoE model's experts split whole over `model` (8 experts: 1 per device on model=8), its
    MLP width within an expert unsplit; the router replicated."""
    for mesh_name, shards in worker_results["moe"]["shards"].items():
        expert_spec = "P()" if mesh_name.endswith("x1") else "P('model',)"
        assert shards["specs"]["experts_w_gate"] == shards["specs"]["experts_w_down"] == expert_spec, mesh_name
        assert shards["specs"]["router"] == "P()", mesh_name


@pytest.mark.parametrize("model", ["divisible", "nondivisible"])
def test_params_and_caches_are_sharded(worker_results, model):
    result = worker_results[model]
    for mesh_name, shards in result["shards"].items():
        data, parts = (int(x) for x in mesh_name.split("x"))
        wq_spec, cache_spec = EXPECTED_SHARDS[(model, mesh_name)]
        assert shards["specs"]["wq"] == wq_spec, mesh_name
        assert shards["cache_spec"] == cache_spec, mesh_name
        assert shards["specs"]["embed"] == "P('model',)"  # vocab 128 divides every model axis
        assert shards["specs"]["w_up"] == "P(None, 'model')"
        assert shards["num_devices_holding"] == 8
        # Bytes per device: a sharded wq holds 1/model of the weight on each device.
        wq_share = shards["wq_bytes"] // parts if wq_spec != "P()" else shards["wq_bytes"]
        assert set(shards["wq_shard_bytes"]) == {wq_share}, mesh_name
        (per_device,) = shards["param_bytes_per_device"]  # every device holds the same
        assert per_device < shards["param_bytes_total"], mesh_name
        if model == "divisible" and mesh_name != "1x8":
            # Everything but the norms is split over `model`.
            assert per_device < shards["param_bytes_total"] / parts * 1.1, mesh_name
    if model == "nondivisible":
        # The replication note is logged once per weight tree and mesh, not once per call.
        # (Only the 2-layer target has a layer 1; the 1-layer drafters log notes of their own.)
        note = "['layers'][1]['wq'] (72, 9, 8): dim 1 (q_heads=9) over model="
        lines = [line for line in result["stderr"].splitlines() if note in line]
        meshes_with_model = {m for m in result["shards"] if not m.endswith("x1")}
        assert len(lines) == len(meshes_with_model), lines


@pytest.mark.skipif(
    not os.environ.get("SPEC_JAX_REAL_SHARDING"),
    reason="the real 135M model on 8 fake CPU devices takes minutes; set SPEC_JAX_REAL_SHARDING=1",
)
def test_real_default_model_sharded_matches_unsharded():
    """SmolLM2-135M (heads do not divide 4 or 8: attention replicated, vocab and MLP split)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(WORKER.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    cases = ["ar@2x4", "ngram@1x8", "draft_model@4x2"]
    proc = subprocess.run(
        [sys.executable, str(WORKER), "default", ",".join(cases)],
        capture_output=True, text=True, env=env, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, case in result["cases"].items():
        assert case["equal"] and case["guarded_equal"], name
        assert case["host_ops"] == [] and case["cache_within_rule"], name
    for mesh_name, shards in result["shards"].items():
        assert shards["specs"]["wq"] == "P()", mesh_name  # 9 heads: replicated, with a note
        assert shards["specs"]["w_up"] != "P()", mesh_name  # MLP width 1536 splits

"""The drafter registry: every place that names drafter kinds reads it, and a kind defined only
in a test file (tests/registry_example_drafter.py) registers itself and then loads, generates
exactly, trains a step and shows in the command line's help, with no edit to spec_jax/."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import spec_jax
from spec_jax.app.inputs import UsageError, parse_drafter_spec
from spec_jax.app.main import main
from spec_jax.checkpoints import save_hf_dir
from spec_jax.drafters import registry
from spec_jax.models import init_params
from spec_jax.models.config import ModelConfig
from spec_jax.training.data import TokenDataset

VOCAB = 48


def test_the_built_in_kinds():
    assert registry.names() == (
        "none", "ngram", "suffix", "self", "draft-model", "dflash", "eagle3", "medusa", "mtp",
        "draft-model+ngram", "dflash+ngram", "eagle3+ngram", "medusa+ngram", "mtp+ngram",
        "draft-model+suffix", "dflash+suffix", "eagle3+suffix", "medusa+suffix", "mtp+suffix")
    assert [k.name for k in registry.trainable()] == ["draft-model", "dflash", "eagle3", "medusa", "mtp"]
    assert all(k.help for k in registry.kinds())
    assert "eagle3=PATH" in registry.synopsis() and "dflash[=PATH]" in registry.synopsis()
    for kind in registry.trainable():  # recipes are named lazily: each resolves to a Recipe
        assert kind.recipe_class().kind == kind.name
    with pytest.raises(ValueError, match="unknown drafter 'ngram\\+ngram'"):
        registry.parse("ngram+ngram")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("ngram"))
    with pytest.raises(ValueError, match="may not contain"):
        registry.register(registry.DrafterKind("a+ngram", "", "x:y"))
    with pytest.raises(ValueError, match="unknown drafter 'suffix\\+suffix'"):
        registry.parse("suffix+suffix")
    assert registry.parse("dflash+suffix") == (registry.get("dflash"), registry.SUFFIX)


def test_reading_the_registry_imports_no_training_code():
    """The registry is read for every --help: it names recipes (and loaders) without importing them."""
    import subprocess
    import sys

    code = ("import sys; from spec_jax.drafters import registry; registry.names(); registry.described(); "
            "assert not [m for m in sys.modules if m.startswith('spec_jax.training')]")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def example_kind():
    import registry_example_drafter

    registry.register(registry_example_drafter.ENTRY, replace=True)
    yield registry_example_drafter
    registry.unregister(registry_example_drafter.KIND)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny random target saved as an HF dir, and its own greedy answers as training data."""
    root = tmp_path_factory.mktemp("registry")
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_ids=())
    params = init_params(cfg, jax.random.key(0), scale=4.0)
    save_hf_dir(root / "target", cfg, jax.device_get(params))
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, VOCAB, 6)) for _ in range(8)]
    out = spec_jax.generate((cfg, params), prompts, max_new_tokens=10)
    data = TokenDataset.from_sequences([p + g for p, g in zip(prompts, out.generated_ids)],
                                       [len(p) for p in prompts], ["test"] * 8)
    data.save(root / "data.npz")
    return root


def test_a_kind_defined_in_a_test_works_end_to_end(example_kind, tiny_run, capsys):
    kind = example_kind.KIND
    # The command line's help lists it, and `spec-jax train` takes it as a kind.
    for command in ("generate", "bench", "info", "train"):
        assert main([command, "--help"]) == 0
        assert kind in capsys.readouterr().out, command
    # One training step through the shared skeleton, driven by the command line.
    run = tiny_run / "run"
    assert main(["train", kind, "--target", str(tiny_run / "target"), "--data", str(tiny_run / "data.npz"),
                 "--out", str(run), "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                 "--warmup-steps", "0", "--eval-prompts", "2", "--eval-tokens", "4", "--k", "2",
                 "--no-progress"]) == 0
    log = json.loads((run / "training_log.json").read_text())
    assert log["kind"] == kind and log["k"] == 2 and log["history"][0]["step"] == 1
    assert log["target_features"] == "none" and log["evals"][-1]["step"] == 1
    # Loaded by name (and behind prompt lookup), it decodes exactly what the target alone does.
    target = spec_jax.load_target(str(tiny_run / "target"))
    drafter, params = spec_jax.load_drafter(kind, target, str(run / "drafter"))
    assert type(drafter).__name__ == "TableDrafter" and drafter.k == 3  # the entry's default K
    prompts = [[3, 4, 5, 3, 4], [7, 8, 9]]
    ar = spec_jax.generate(target, prompts, max_new_tokens=8)
    spec = spec_jax.generate(target, prompts, drafter, params, max_new_tokens=8)
    assert spec.generated_ids == ar.generated_ids
    lookup, _ = spec_jax.load_drafter(kind + "+ngram", target, str(run / "drafter"), k=2)
    assert type(lookup).__name__ == "LookupFirstDrafter" and lookup.k == 2
    assert parse_drafter_spec(f"{kind}={run}").kind == kind
    with pytest.raises(UsageError, match="unknown drafter"):
        parse_drafter_spec("bigram")
    with pytest.raises(ValueError, match=f"{kind}.*needs a checkpoint for this target"):
        spec_jax.load_drafter(kind, target)

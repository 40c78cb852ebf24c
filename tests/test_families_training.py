"""`spec-jax train dflash | eagle3 | draft-model` on a tiny Gemma 3 target (sandwich (1 + w)
norms, GeGLU, sqrt(H)-scaled embeddings, sliding + full layers with their own RoPE): each trains,
exports, and the export loads back against the target."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from spec_jax.app.main import main
from spec_jax.checkpoints import save_hf_dir
from spec_jax.models import ModelConfig, init_params
from spec_jax.training.data import TokenDataset

SEQ_LEN = 32
GEMMA3 = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-6, rope_theta=100_000.0, tie_embeddings=True, qk_norm=True,
    layer_types=("sliding_attention", "full_attention") * 2, sliding_window=6, architecture="gemma3", bos_token_id=None,
    eos_token_ids=(), norm_offset=1.0, sandwich_norms=True, mlp_activation="gelu_tanh",
    scale_embeddings=True, query_pre_attn_scalar=24.0, sliding_rope_theta=1000.0,
)


@pytest.fixture(scope="module")
def gemma3_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_train")
    params = init_params(GEMMA3, jax.random.key(0), scale=3.0)
    save_hf_dir(root / "target", GEMMA3, jax.device_get(params))
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 120, rng.randint(3, 9))) for _ in range(16)]
    # Random answers (the drafters learn from the target's features, whatever the text): no
    # decoding loop to compile. frequent_draft_vocab sizes its counts by the largest token id
    # seen, so the vocabulary's last id is in the data: EAGLE-3's full-vocabulary head gets all 128.
    answers = [list(rng.randint(3, GEMMA3.vocab_size, 16)) for _ in prompts]
    answers[1][-1] = GEMMA3.vocab_size - 1
    data = TokenDataset.from_sequences([p + a for p, a in zip(prompts, answers)],
                                       [len(p) for p in prompts], ["test"] * len(prompts))
    data.save(root / "data.npz")
    return root, prompts


# The draft model trains on the target's logits alone (no embedding or captured layers), so it is
# left out here to save the suite ~20 s: `spec-jax train draft-model` on this target passes too.
@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_train_export_and_load_on_a_gemma3_target(gemma3_run, tmp_path, kind):
    """Each kind trains on the Gemma target's features (its captured layers, scaled embedding and
    logits), exports, and the export loads and validates against the target. Their exactness on
    Gemma 3 is test_families' (random weights; the weights do not change the acceptance rule), so
    no decoding loop is compiled here."""
    from spec_jax.checkpoints import load_target
    from spec_jax.checkpoints.shipped import load_drafter

    root, _ = gemma3_run
    out = tmp_path / "run"
    args = ["train", kind, "--target", str(root / "target"), "--data", str(root / "data.npz"),
            "--out", str(out), "--steps", "2", "--batch-size", "4", "--seq-len", str(SEQ_LEN),
            "--block-size", "4", "--layers", "1", "--hidden", "64", "--eval-every", "0", "--no-progress"]
    assert main(args) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log, "no training log"
    target = load_target(str(root / "target"))
    drafter, params = load_drafter(kind, target, str(out / "drafter"))
    drafter.validate(target.model, 256)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(params))
    if kind == "eagle3":  # its layers run the plain math: the exported config says so
        layer = json.loads((out / "drafter" / "config.json").read_text()).get("transformer_layer_config", {})
        assert drafter.cfg.layer.architecture == "qwen3" and not drafter.cfg.layer.sandwich_norms
        assert layer.get("model_type", "qwen3") == "qwen3"

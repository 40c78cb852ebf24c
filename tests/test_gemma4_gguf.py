"""A Gemma 4 GGUF written here as llama.cpp's converter writes one (its `Gemma4Model`: the metadata
keys and the tensor names of the installed `gguf` package's GEMMA4 architecture, norms unshifted,
the full layers' proportional RoPE as a `rope_freqs` tensor) loads with the config and weights
the HF checkpoint it came from loads with. The tiny Gemma 4 of tests/tiny_configs.py turns on
per-layer embeddings, KV sharing with a double-wide MLP, and k_eq_v full layers with their own
head size and KV heads. No forward pass: equal config and weights are the same model."""

from __future__ import annotations

import json
import warnings

import jax
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from spec_jax.checkpoints import load_hf_dir, save_hf_dir  # noqa: E402
from spec_jax.checkpoints.gguf import load_gguf  # noqa: E402
from spec_jax.models import init_params  # noqa: E402
from tiny_configs import TINY_GEMMA4  # noqa: E402


def write_gemma4_gguf(hf_dir, path) -> None:
    """What `convert_hf_to_gguf.py` (Gemma4Model over Gemma3Model) writes for a text checkpoint."""
    from safetensors.numpy import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    hp = hp.get("text_config", hp)
    layers, types = hp["num_hidden_layers"], hp["layer_types"]
    shared = hp["num_kv_shared_layers"]
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_block_count(layers)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_rope_freq_base(hp["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(hp["rope_parameters"]["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    writer.add_sliding_window(hp["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(hp["hidden_size_per_layer_input"])
    swa = [t == "sliding_attention" for t in types]
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(hp["global_head_dim"])
    writer.add_value_length(hp["global_head_dim"])
    writer.add_key_length_swa(hp["head_dim"])
    writer.add_value_length_swa(hp["head_dim"])
    ff = hp["intermediate_size"]
    writer.add_feed_forward_length([ff if i < layers - shared else 2 * ff for i in range(layers)]
                                   if hp["use_double_wide_mlp"] else ff)
    writer.add_head_count_kv([hp["num_key_value_heads"] if s else hp["num_global_key_value_heads"] for s in swa])
    writer.add_rope_dimension_count(hp["global_head_dim"])
    writer.add_rope_dimension_count_swa(hp["head_dim"])
    writer.add_tokenizer_model("gemma4")
    writer.add_bos_token_id(hp["bos_token_id"])  # the converter's SpecialVocab
    writer.add_eos_token_id(hp["eos_token_id"])
    writer.add_token_list(["<pad>", "<eos>", "<bos>"] + [f"t{i}" for i in range(hp["vocab_size"] - 3)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for name, value in load_file(str(hf_dir / "model.safetensors")).items():
        if name.endswith("layer_scalar"):
            name += ".weight"  # as the converter's filter_tensors does
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), value.astype(np.float32))
    # The full layers' proportional RoPE: 1 per rotated pair, 1e30 for the rest.
    half = hp["global_head_dim"] // 2
    rotated = int(hp["global_head_dim"] * hp["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (half - rotated), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gemma4_gguf_loads_as_its_hf_checkpoint(tmp_path):
    rng = np.random.default_rng(0)  # every tensor random (norms too), drawn on the host: nothing compiles
    shapes = jax.eval_shape(lambda: init_params(TINY_GEMMA4, jax.random.key(0)))
    params = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), shapes)
    save_hf_dir(tmp_path / "hf", TINY_GEMMA4, params)
    write_gemma4_gguf(tmp_path / "hf", tmp_path / "tiny.gguf")
    want_cfg, want = load_hf_dir(tmp_path / "hf", "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg, got, tokenizer, _ = load_gguf(tmp_path / "tiny.gguf")
    assert tokenizer is None and any("'gemma4' tokenizer is not rebuilt" in str(w.message) for w in caught)
    differ = {k: (getattr(cfg, k), getattr(want_cfg, k)) for k in want_cfg.__dataclass_fields__
              if getattr(cfg, k) != getattr(want_cfg, k)}
    assert differ == {}
    assert cfg.attention_k_eq_v and cfg.num_kv_shared_layers == 1 and cfg.per_layer_input_size == 8
    want, got = (dict(jax.tree_util.tree_leaves_with_path(p)) for p in (want, got))
    assert want.keys() == got.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=jax.tree_util.keystr(name))

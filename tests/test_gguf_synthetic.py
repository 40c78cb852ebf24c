"""A tiny GGUF written here from a random transformers Llama: exercises the q/k row unpermute, the
config and tokenizer metadata and the dequantized-model disk cache without the 100 MB default."""

import warnings

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import spec_jax.checkpoints as checkpoints  # noqa: E402
from spec_jax.checkpoints import CheckpointError, load_target  # noqa: E402
from spec_jax.checkpoints.gguf import _metadata, permute_rotary_rows, tokenizer_from_gguf  # noqa: E402
from spec_jax.models import forward, init_cache  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _byte_alphabet():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def _write_gguf(model, path, arch="llama"):
    cfg = model.config
    tokens = SPECIALS + _byte_alphabet()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges([])
    writer.add_token_types([3] * len(SPECIALS) + [1] * 256)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, value in model.state_dict().items():
        w = value.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:  # state_dict lists the tied head too; GGUF omits it
                writer.add_tensor("output.weight", w)
        else:
            _, _, i, *rest = name.split(".")
            kind = names[".".join(rest[:-1])]
            # As llama.cpp's converter does: q/k rows reordered for interleaved rotary.
            if kind == "attn_q":
                w = permute_rotary_rows(w, cfg.num_attention_heads)
            elif kind == "attn_k":
                w = permute_rotary_rows(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{kind}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(SPECIALS) + 256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=request.param,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(model, path)
    return model, path


def test_tiny_gguf_matches_transformers(tiny, tmp_path):
    model, path = tiny
    loaded = load_target(str(path), cache_dir="")  # on CPU a tied head is untied
    published = load_target(str(path), cache_dir="", untie_head=False).cfg
    assert published.tie_embeddings == model.config.tie_word_embeddings and not loaded.cfg.tie_embeddings
    assert (loaded.cfg.num_heads, loaded.cfg.num_kv_heads, loaded.cfg.head_dim) == (4, 2, 16)
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    logits, _, _ = forward(
        loaded.params, loaded.cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(10), (2, 10)),
        init_cache(loaded.cfg, 2, 16),
    )  # fmt: skip
    assert np.abs(np.asarray(logits) - ref).max() < 1e-4


def test_tiny_gguf_tokenizer(tiny):
    _, path = tiny
    loaded = load_target(str(path), cache_dir="")
    tok = loaded.tokenizer
    text = "ab 12<|im_end|>é"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(2) == 1  # the control token stays whole
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    assert loaded.chat_template == TEMPLATE


def test_disk_cache_reused_and_rebuilt_when_damaged(tiny, tmp_path):
    _, path = tiny
    checkpoints._load_gguf_cached.cache_clear()
    first = load_target(str(path), cache_dir=tmp_path)
    (entry,) = list(tmp_path.iterdir())
    assert (entry / "model.safetensors").exists() and (entry / "tokenizer.json").exists()
    checkpoints._load_gguf_cached.cache_clear()
    second = load_target(str(path), cache_dir=tmp_path)
    assert second.cfg == first.cfg and second.chat_template == first.chat_template
    np.testing.assert_array_equal(np.asarray(second.params["embed"]), np.asarray(first.params["embed"]))
    # A truncated cache entry warns and is rebuilt from the GGUF file.
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    checkpoints._load_gguf_cached.cache_clear()
    with pytest.warns(UserWarning, match="damaged GGUF cache"):
        third = load_target(str(path), cache_dir=tmp_path)
    np.testing.assert_array_equal(np.asarray(third.params["embed"]), np.asarray(first.params["embed"]))
    checkpoints._load_gguf_cached.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_target(str(path), cache_dir=tmp_path)


def test_unsupported_gguf_architecture(tiny, tmp_path):
    model, _ = tiny
    path = tmp_path / "other.gguf"
    _write_gguf(model, path, arch="gpt2")
    with pytest.raises(CheckpointError, match=r"Unsupported GGUF architecture 'gpt2'.*HF safetensors"):
        load_target(str(path), cache_dir="")


def test_truncated_gguf(tiny, tmp_path):
    _, src = tiny
    path = tmp_path / "cut.gguf"
    path.write_bytes(src.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_target(str(path), cache_dir="")


def _tokenizer_only_gguf(path, pre):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(SPECIALS + _byte_alphabet())
    writer.add_token_merges([])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return reader, _metadata(reader)


def test_a_transformers_without_the_split_table_still_reads_gpt2_splits(tmp_path, monkeypatch):
    """transformers 5.17 (a GPU image's) lacks GGUF_PRE_TOKENIZER_SPLITS: the default model's
    "smollm" split needs no table and loads; a qwen2 split names the version that has it."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    monkeypatch.delattr(gguf_tokenizer_mapping, "GGUF_PRE_TOKENIZER_SPLITS")
    reader, meta = _tokenizer_only_gguf(tmp_path / "smollm.gguf", "smollm")
    tok = tokenizer_from_gguf(reader, meta)
    assert tok.decode(tok.encode("ab 12")) == "ab 12"
    reader, meta = _tokenizer_only_gguf(tmp_path / "qwen2.gguf", "qwen2")
    with pytest.raises(CheckpointError, match=r"pre-split 'qwen2' needs transformers >= 5\.18"):
        tokenizer_from_gguf(reader, meta)

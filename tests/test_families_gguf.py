"""Qwen2 and Gemma 3 GGUF files written here as llama.cpp's converter writes them (Qwen2: q/k/v
biases, byte-level BPE with the qwen2 split; Gemma 3: norms stored as 1 + w, its own norm names,
a sentencepiece vocabulary) load with transformers-equal logits, a working tokenizer and chat
template, and survive the dequantized-model disk cache."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import spec_jax.checkpoints as checkpoints  # noqa: E402
from spec_jax.checkpoints import apply_chat_template, load_target  # noqa: E402
from spec_jax.models import forward, init_cache  # noqa: E402
from spec_jax.models.config import GLOBAL_WINDOW  # noqa: E402

TEMPLATE = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_QWEN2 = {**_NAMES, "post_attention_layernorm": "ffn_norm"}
_GEMMA3 = {**_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
           "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}


def _byte_alphabet():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def _spm_vocab():
    """A Gemma-like sentencepiece vocabulary: specials, byte fallback, pieces with '▁'."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "lo", "▁he", "▁hel", "▁hell", "▁hello",
              "▁w", "▁wo", "or", "▁wor", "▁worl", "▁world"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, types


def _write(model, path, arch):
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    if arch == "gemma3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
        tokens, types = _spm_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores([0.0] * len(tokens))
        names = _GEMMA3
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        tokens = ["<|endoftext|>", "<eos>", "<|im_start|>"] + _byte_alphabet()
        writer.add_token_list(tokens)
        writer.add_token_merges([])
        writer.add_token_types([3, 3, 3] + [1] * 256)
        names = _QWEN2
    for name, value in model.state_dict().items():
        w = value.numpy().astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp's Gemma convert: its RMSNorm has no (1 + w)
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                writer.add_tensor("output.weight", w)
        else:
            _, _, i, *rest = name.split(".")
            writer.add_tensor(f"blk.{i}.{names['.'.join(rest[:-1])]}.{rest[-1]}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, rope_theta=10000.0)
    return transformers.Qwen2ForCausalLM(cfg)


def _gemma3():
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}  # llama.cpp's local base
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(_spm_vocab()[0]), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"], rope_parameters=rope)
    return transformers.Gemma3ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def written(request, tmp_path_factory):
    torch.manual_seed(0)
    model = {"qwen2": _qwen2, "gemma3": _gemma3}[request.param]().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "bias" in pname:
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    _write(model, path, request.param)
    return request.param, model, path


def test_gguf_logits_tokenizer_and_cache(written, tmp_path):
    arch, model, path = written
    checkpoints._load_gguf_cached.cache_clear()
    loaded = load_target(str(path), cache_dir=tmp_path)  # dequantized once, kept as an HF dir
    checkpoints._load_gguf_cached.cache_clear()
    cached = load_target(str(path), cache_dir=tmp_path)
    assert cached.cfg == loaded.cfg and loaded.cfg.architecture == arch
    if arch == "gemma3":
        assert loaded.cfg.layer_windows == (4, GLOBAL_WINDOW) and loaded.cfg.sliding_rope_theta == 10000.0
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    for target in (loaded, cached):
        logits, _, _ = forward(target.params, target.cfg, jnp.asarray(tokens),
                               jnp.broadcast_to(jnp.arange(10), (2, 10)), init_cache(target.cfg, 2, 16))
        assert np.abs(np.asarray(logits) - ref).max() < 1e-4
    for tok in (loaded.tokenizer, cached.tokenizer):
        text = "hello world" if arch == "gemma3" else "ab 12<eos>é"
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    if arch == "gemma3":
        # BOS added; no dummy prefix before the first word (Gemma), '▁' before the second.
        pieces = loaded.tokenizer.convert_ids_to_tokens(loaded.tokenizer.encode("hello world"))
        assert pieces == ["<bos>", "he", "ll", "o", "▁world"]
        assert loaded.tokenizer.eos_token == "<eos>" and loaded.chat_template == TEMPLATE
        ids = apply_chat_template(loaded.tokenizer, "hello", loaded.chat_template)
        assert ids[:2] == [2, 4]  # <bos> <start_of_turn>
        assert 5 in loaded.stop_ids  # <end_of_turn> ends the assistant's turn
    else:
        assert ids.count(1) == 1  # the control token stays whole

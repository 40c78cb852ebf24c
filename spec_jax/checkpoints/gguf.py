"""GGUF files (llama.cpp) -> (ModelConfig, fp32 params, tokenizer), without torch.

Tensors are dequantized with `gguf.quants.dequantize`. A GGUF tensor read as numpy has HF's
[out, in] layout, so GGUF names are mapped to HF names and the family's HF table does the rest.
What llama.cpp's converter changed is undone per architecture:
  llama   q/k projection rows permuted (per head, from HF's rotate-half order to interleaved
          pairs); `unpermute_rotary_rows` undoes that. Mistral files are written as `llama`.
  qwen2   nothing (q/k/v biases as `attn_{q,k,v}.bias`).
  gemma3  every `*norm.weight` stored as 1 + w (llama.cpp's RMSNorm has no offset): minus 1 here.
          The file omits what llama.cpp hard-codes for Gemma 3, so those come from the same
          rules: local RoPE base 10k (or `rope.freq_base_swa`), five sliding layers per full
          one (or `attention.sliding_window_pattern`), attention scale head_dim ** -0.5
          (hidden / heads for the 62-layer 27B).
  gemma4  norms as they are (no 1 + w). Per layer in the metadata: `attention.sliding_window_pattern`
          (True = sliding), `attention.head_count_kv` and `feed_forward_length` (arrays when the
          full layers have their own KV heads, or the KV-shared layers a double-wide MLP);
          `attention.key_length` is the full layers' head size, `key_length_swa` the sliding
          ones'; `attention.shared_kv_layers`, `embedding_length_per_layer_input`. Full layers
          without `attn_v` are attention_k_eq_v; the `rope_freqs` tensor (1 for each rotated
          pair, 1e30 for the rest) gives the proportional RoPE's partial rotary factor. Its
          tokenizer model ('gemma4') is not rebuilt here (the load warns; use token ids or the HF
          checkpoint's tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from spec_jax.checkpoints.errors import CheckpointError, CheckpointNotFoundError
from spec_jax.checkpoints.hf import check_hf_tensors, expected_hf_shapes, params_from_hf, unused_shared_kv_names
from spec_jax.models.config import FULL_ATTENTION, SLIDING_ATTENTION, LinearRopeScaling, ModelConfig, ProportionalRope

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3", "gemma4")

# GGUF tensor name -> HF name; `{i}` is the block index.
_GGUF_TO_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms differently (see hf_names.py); q/k norms are per head.
_GGUF_TO_HF_GEMMA3_LAYER = {
    **_GGUF_TO_HF_LAYER,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 4 adds the per-layer-embedding branch and the layer scalar (gguf's own tensor map).
_GGUF_TO_HF_GEMMA4_LAYER = {
    **_GGUF_TO_HF_GEMMA3_LAYER,
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GGUF_TO_HF_MODEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_TO_HF_GEMMA4_MODEL = {
    **_GGUF_TO_HF_MODEL,
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# Read for the config (proportional RoPE's rotated dims), not a weight.
_GEMMA4_ROPE_FREQS = "rope_freqs.weight"

# gguf token types (llama.cpp `llama_token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def hf_name_of(gguf_name: str, arch: str = "llama") -> str | None:
    model_names = _GGUF_TO_HF_GEMMA4_MODEL if arch == "gemma4" else _GGUF_TO_HF_MODEL
    if gguf_name in model_names:
        return model_names[gguf_name]
    layer_names = {"gemma3": _GGUF_TO_HF_GEMMA3_LAYER, "gemma4": _GGUF_TO_HF_GEMMA4_LAYER}.get(arch, _GGUF_TO_HF_LAYER)
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight (or .bias: Qwen2's q/k/v)
    if arch == "gemma4" and parts[2:] == ["layer_output_scale", "weight"]:
        return f"model.layers.{parts[1]}.layer_scalar"  # HF's name has no ".weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows are stored as interleaved
    (re, im) pairs [d0, d_half, d1, d_half+1, ...]; HF's rotate-half wants [first half, second half].
    w: [num_heads * D, in]."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    # stored index (head, j, pair) <- HF index (head, pair, j)
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved order (inverse of `unpermute_rotary_rows`)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open_reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise CheckpointNotFoundError(f"GGUF file {str(path)!r} does not exist; pass an existing .gguf file.")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it may be truncated or "
            "corrupt, re-download it."
        ) from e


def _metadata(reader) -> dict[str, Any]:
    big = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    return {k: f.contents() for k, f in reader.fields.items() if k not in big}


def _short_float(x: float) -> float:
    # GGUF stores float32; 9.999999747e-06 reads back as the 1e-05 the model was trained with.
    return float(str(np.float32(x)))


def config_from_gguf(
    meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], dtype: str = "float32",
    rope_freqs: np.ndarray | None = None,
) -> ModelConfig:
    """ModelConfig from GGUF metadata; `tensor_shapes` (GGUF name -> [out, in]) fills the gaps:
    the vocab size when the metadata omits it, tied embeddings when there is no output.weight
    (Gemma 4: which full layers lack attn_v, the per-layer table's vocabulary; `rope_freqs`, its
    rope_freqs tensor, the full layers' rotated dims)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"Unsupported GGUF architecture {arch!r}; spec_jax reads {SUPPORTED_GGUF_ARCHITECTURES} "
            "GGUF files. Use the model's HF safetensors checkpoint instead."
        )

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"GGUF metadata lacks {full!r}; the file is incomplete, re-convert it.")
        return meta[full]

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
    num_kv_heads = int(num_kv_heads[0] if isinstance(num_kv_heads, (list, tuple)) else num_kv_heads)
    head_dim = int(
        meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // num_heads
    )
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        if "token_embd.weight" not in tensor_shapes:
            raise CheckpointError("GGUF file has no token_embd.weight; it is not a complete model.")
        vocab = tensor_shapes["token_embd.weight"][0]
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if arch == "gemma3" and scaling_type == "linear":
        rope_scaling = LinearRopeScaling(_short_float(need("rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise CheckpointError(
            f"GGUF rope scaling {scaling_type!r} is not supported for GGUF files; use the HF checkpoint."
        )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    num_layers = int(need("block_count"))
    family: dict[str, Any] = {}
    if arch == "qwen2":
        family = dict(architecture="qwen2", qkv_bias=True)
    elif arch == "gemma3":
        family = _gemma3_fields(meta, num_layers, hidden, num_heads, head_dim, rope_scaling)
    elif arch == "gemma4":
        family = _gemma4_fields(meta, num_layers, tensor_shapes, rope_freqs)
        head_dim = int(need("attention.key_length_swa"))
    intermediate = need("feed_forward_length")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(intermediate[0] if isinstance(intermediate, (list, tuple)) else intermediate),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_short_float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=_short_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in tensor_shapes,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 8192)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        dtype=dtype,
        **{"architecture": "llama", "qk_norm": False, **family},
    )


def _gemma3_fields(meta, num_layers, hidden, num_heads, head_dim, rope_scaling) -> dict[str, Any]:
    """Gemma 3's config switches from GGUF metadata plus llama.cpp's hard-coded Gemma 3 rules."""
    window = int(meta.get("gemma3.attention.sliding_window") or 0)
    if not window:
        raise CheckpointError("GGUF metadata lacks 'gemma3.attention.sliding_window'; re-convert the file.")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):  # per layer: True = sliding
        sliding = [bool(pattern[i % len(pattern)]) for i in range(num_layers)]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(num_layers)]
    # llama.cpp: attention scale 1/sqrt(hidden / heads) for the 27B (62 layers), else 1/sqrt(head_dim).
    scalar = hidden // num_heads if num_layers == 62 else head_dim
    return dict(
        architecture="gemma3", qk_norm=True, norm_offset=1.0, sandwich_norms=True,
        mlp_activation="gelu_tanh", scale_embeddings=True, query_pre_attn_scalar=float(scalar),
        layer_types=tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding),
        sliding_window=window,
        sliding_rope_theta=_short_float(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
        rope_scaling=rope_scaling,
    )


def _gemma4_fields(meta, num_layers, tensor_shapes, rope_freqs) -> dict[str, Any]:
    """Gemma 4's config switches from GGUF metadata and tensors (the module doc); what llama.cpp
    hard-codes for Gemma 4 (scaled embeddings, unscaled q.k, the v-norm, layer scalars, GELU)
    comes from the architecture, as spec_jax's Gemma 4 presets have it."""

    def need(key: str):
        if f"gemma4.{key}" not in meta:
            raise CheckpointError(f"GGUF metadata lacks 'gemma4.{key}'; re-convert the file.")
        return meta[f"gemma4.{key}"]

    def per_layer(value) -> list[int]:
        return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * num_layers

    sliding = [bool(s) for s in need("attention.sliding_window_pattern")]
    if len(sliding) != num_layers:
        raise CheckpointError(f"GGUF 'gemma4.attention.sliding_window_pattern' has {len(sliding)} entries for "
                              f"{num_layers} layers; re-convert the file.")
    full = [i for i, s in enumerate(sliding) if not s]
    kv_heads = per_layer(need("attention.head_count_kv"))
    ff = per_layer(need("feed_forward_length"))
    shared = int(meta.get("gemma4.attention.shared_kv_layers", 0))
    own_kv = [i for i in full if i < num_layers - shared]
    k_eq_v = bool(own_kv) and all(f"blk.{i}.attn_v.weight" not in tensor_shapes for i in own_kv)
    factor = 1.0
    if rope_freqs is not None:  # 1 per rotated pair, 1e30 for the unrotated ones
        factor = float(np.sum(np.asarray(rope_freqs) < 1e20)) / len(rope_freqs)
    full_kv = {kv_heads[i] for i in full}  # the sliding layers' count is the config's num_kv_heads (layer 0's)
    per_layer_input = int(meta.get("gemma4.embedding_length_per_layer_input", 0) or 0)
    return dict(
        architecture="gemma4", qk_norm=True, sandwich_norms=True, mlp_activation="gelu_tanh",
        scale_embeddings=True, query_pre_attn_scalar=1.0, value_norm=True, layer_scalar=True,
        final_logit_softcapping=meta.get("gemma4.final_logit_softcapping"),
        layer_types=tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding),
        sliding_window=int(need("attention.sliding_window")),
        sliding_rope_theta=_short_float(meta.get("gemma4.rope.freq_base_swa", 10_000.0)),
        rope_scaling=ProportionalRope(factor) if factor != 1.0 else None,
        global_head_dim=int(need("attention.key_length")),
        num_global_kv_heads=full_kv.pop() if len(full_kv) == 1 and kv_heads[full[0]] != kv_heads[0] else None,
        attention_k_eq_v=k_eq_v, num_kv_shared_layers=shared,
        double_wide_mlp=shared > 0 and ff[-1] == 2 * ff[0],
        per_layer_input_size=per_layer_input,
        per_layer_vocab_size=tensor_shapes.get("per_layer_token_embd.weight", (0,))[0] if per_layer_input else 0,
    )


# `tokenizer.ggml.pre` values whose split is GPT-2's own (ByteLevel's regex) or GPT-2's with every
# digit on its own: they need no table from transformers.
_GPT2_SPLIT_PRE = (None, "gpt2", "gpt-2", "default")
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
# The first transformers release with GGUF_PRE_TOKENIZER_SPLITS (5.17 lacks it).
_SPLITS_TRANSFORMERS = "5.18"


def _pre_tokenizer_split(pre: str | None) -> str | None:
    """The split regex of a vocabulary whose merges were learned on a split other than GPT-2's
    (qwen2, llama-bpe, ...), from transformers' table; None for GPT-2's own split."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        # Imported here, not at module level: the default model's vocabulary ("smollm") needs no
        # table, so an older transformers (a GPU image's 5.17) still loads it.
        if pre in _GPT2_SPLIT_PRE:
            return None
        import transformers

        raise CheckpointError(
            f"this GGUF's tokenizer pre-split {pre!r} needs transformers >= {_SPLITS_TRANSFORMERS} "
            f"(its GGUF_PRE_TOKENIZER_SPLITS table); transformers {transformers.__version__} is "
            f"installed. Upgrade it (pip install -U 'transformers>={_SPLITS_TRANSFORMERS}') or load "
            "the model's HF checkpoint (its tokenizer.json) instead."
        ) from None
    return GGUF_PRE_TOKENIZER_SPLITS.get(pre)


def tokenizer_from_gguf(reader, meta: dict[str, Any]):
    """A `transformers.PreTrainedTokenizerFast` rebuilt from GGUF tokenizer metadata (byte-level BPE).

    Built with `tokenizers` directly: transformers' own GGUF route imports torch.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_tokenizer(reader, meta)
    if kind != "gpt2":
        raise CheckpointError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and sentencepiece "
            "'llama' are); use the HF checkpoint's tokenizer.json."
        )
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges_field = reader.fields.get("tokenizer.ggml.merges")  # absent when a vocab has none
    merges = [tuple(m.split(" ", 1)) for m in merges_field.contents()] if merges_field is not None else []
    types_field = reader.fields.get("tokenizer.ggml.token_type")
    token_types = types_field.contents() if types_field is not None else [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre")
    split = None if pre in _DIGIT_SPLIT_PRE else _pre_tokenizer_split(pre)
    if pre in _DIGIT_SPLIT_PRE:
        # llama.cpp splits every digit on its own before the GPT-2 regex for these vocabularies
        # (as their HF tokenizer.json does with a `Digits(individual_digits=True)` step).
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    elif split is not None:
        # Vocabularies whose merges were learned on another split than GPT-2's (qwen2, llama-bpe).
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, kind_ in zip(tokens, token_types)
        if kind_ == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind_ in zip(tokens, token_types)
        if kind_ == _TOKEN_USER_DEFINED
    ]
    tok.add_special_tokens(specials)
    tok.add_tokens(user)

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _sentencepiece_tokenizer(reader, meta: dict[str, Any]):
    """A sentencepiece vocabulary (`tokenizer.ggml.model` 'llama': Gemma, Llama 2, Mistral) as a
    fast tokenizer, built by transformers' torch-free GGUF tokenizer converters."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    spec: dict[str, Any] = {"tokenizer_type": "llama", "tokens": tokens}
    for key, name in (("scores", "scores"), ("token_type", "token_type"), ("merges", "merges")):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            spec[name] = field.contents()
    if "scores" not in spec and "merges" not in spec:
        spec["scores"] = [0.0] * len(tokens)
    backend, _ = convert_gguf_tokenizer(meta.get("general.architecture"), spec)

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = token("bos_token_id")
    # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
    if bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    else:
        backend.post_processor = None
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def load_gguf(path: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, dict, Any, str | None]:
    """(config, host numpy params, tokenizer, chat template) from a GGUF file.

    Names and shapes are checked against the metadata before anything is dequantized.
    """
    import jax.numpy as jnp
    from gguf.quants import dequantize

    path = Path(path).expanduser()
    reader = _open_reader(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    # GGUF shapes are listed fastest-axis first; reversed they are HF's [out, in].
    gguf_shapes = {n: tuple(int(d) for d in reversed(t.shape)) for n, t in tensors.items()}
    rope_freqs = tensors.pop(_GEMMA4_ROPE_FREQS, None) if meta.get("general.architecture") == "gemma4" else None
    cfg = config_from_gguf(meta, gguf_shapes, dtype, None if rope_freqs is None else np.asarray(rope_freqs.data))
    arch = meta.get("general.architecture")

    unknown = sorted(n for n in tensors if hf_name_of(n, arch) is None)
    if unknown:
        raise CheckpointError(
            f"GGUF file {path} holds tensors spec_jax does not know: {unknown[:8]}; it is not a plain "
            f"{arch} decoder."
        )
    by_hf = {hf_name_of(n, arch): t for n, t in tensors.items()}
    shapes = {hf_name_of(n, arch): s for n, s in gguf_shapes.items() if n in tensors}
    # Gemma 4: k/v of the KV-shared layers may be in the file; nothing reads them.
    check_hf_tensors(shapes, expected_hf_shapes(cfg), str(path), unused_shared_kv_names(cfg))

    np_dtype = jnp.dtype(dtype)

    def get_tensor(hf_name: str) -> np.ndarray:
        t = by_hf[hf_name]
        w = dequantize(t.data, t.tensor_type).reshape(shapes[hf_name])
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rotary_rows(w, cfg.num_heads)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rotary_rows(w, cfg.num_kv_heads)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w)
        return np.asarray(w, dtype=np_dtype)

    params = params_from_hf(get_tensor, cfg)
    return cfg, params, _tokenizer(reader, meta), meta.get("tokenizer.chat_template")


def _tokenizer(reader, meta: dict[str, Any]):
    """`tokenizer_from_gguf`, or None with a warning for Gemma 4's own tokenizer model."""
    if meta.get("tokenizer.ggml.model") != "gemma4":
        return tokenizer_from_gguf(reader, meta)
    import warnings

    warnings.warn("spec_jax: the GGUF's 'gemma4' tokenizer is not rebuilt (the weights and config "
                  "load); pass token ids (--prompt-ids), or load the model's HF checkpoint for text.")
    return None

"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers' GGUF loader."""

import functools
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.checkpoints import apply_chat_template, default_gguf_path, load_target
from spec_jax.decoding import generate
from spec_jax.checkpoints.gguf import permute_rotary_rows, unpermute_rotary_rows
from spec_jax.models import forward, init_cache

# Both sides dequantize the same Q4_1/Q8_0 blocks to identical fp32 weights; what differs is fp32
# summation order over 30 layers. Measured max |diff| 1.1e-4 on logits of magnitude ~38 (relative
# ~3e-6); 1e-3 leaves a 10x margin while a wrong permutation or norm gives differences of ~1-10.
LOGIT_ATOL = 1e-3

TEXTS = [
    "Hello world! 12345 def foo(x):\n    return x**2",
    "  leading spaces\tand tabs,\nnewlines and unicode: café, 日本語, emoji 🚀",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>",
]
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "List three colors.",
]


@pytest.fixture(scope="module")
def model(default_model_installed):
    return load_target(None)


@pytest.fixture(scope="module")
def hf_gguf(default_model_installed):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    path = default_gguf_path()
    # transformers' GGUF loader parses the file's metadata (49k vocabulary strings and merges) once
    # for the config, once for the weights and once for the tokenizer, and builds gguf's tensor-name
    # map once per module it walks (397 times for this model): the same file and the same map each
    # time, ~25 s of this fixture's ~35 s. Each is built once here; the loader and its
    # dequantization run as before.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return hf_model, hf_tok


def test_default_model_config(model):
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    # Tied in the file; on CPU `load_target` gives the head its own [H, V] copy.
    assert not cfg.tie_embeddings and model.params["lm_head"].shape == (576, 49152)
    assert load_target(None, untie_head=False).cfg.tie_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert len(model.params["layers"]) == 30
    assert model.params["layers"][0]["wq"].shape == (576, 9, 64)
    assert model.params["embed"].dtype == jnp.float32
    assert load_target(None) is model  # dequantized once per process


def test_chat_template(model):
    assert "<|im_start|>" in model.chat_template
    ids = apply_chat_template(model.tokenizer, "Hi")
    text = model.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert model.tokenizer.convert_tokens_to_ids("<|im_end|>") == model.cfg.eos_token_ids[0]


def test_tokenizer_matches_transformers(model, hf_gguf):
    _, hf_tok = hf_gguf
    tok = model.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids) == text
    assert [int(d) for d in tok.encode("2024")] == [tok.convert_tokens_to_ids(c) for c in "2024"]


def test_logits_match_transformers(model, hf_gguf):
    torch = pytest.importorskip("torch")
    hf_model, _ = hf_gguf
    ids = apply_chat_template(model.tokenizer, PROMPTS[0])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()
    t = len(ids)
    logits, _, _ = forward(model.params, model.cfg, jnp.asarray([ids]), jnp.arange(t)[None], init_cache(model.cfg, 1, t))
    logits = np.asarray(logits)
    assert np.abs(logits - ref).max() < LOGIT_ATOL
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_matches_transformers(model, hf_gguf):
    """spec_jax's jitted AR loop and transformers' greedy decoding, same GGUF: 3 prompts x 64.
    The three go through spec_jax as one batch (one compile of the 30-layer loop; greedy rows do
    not depend on each other, which the decoding tests check). transformers' side is one forward
    pass over the prompt and our 64 tokens: they are its greedy tokens exactly when each is the
    argmax of its logits after the tokens before it (the same test as its `generate`, without 64
    cached steps of the model per prompt)."""
    torch = pytest.importorskip("torch")
    hf_model, _ = hf_gguf
    new_tokens = 64
    prompts = [apply_chat_template(model.tokenizer, prompt) for prompt in PROMPTS]
    out = generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True, capacity=256)
    for prompt, ids, ours in zip(PROMPTS, prompts, out.generated_ids):
        assert len(ours) == new_tokens
        with torch.no_grad():  # no attention mask: every token is real (<|im_end|> is the pad id)
            logits = hf_model(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == ours, prompt


def test_rotary_permutation_roundtrip():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of dim 8
    stored = permute_rotary_rows(w, 6)
    assert not np.array_equal(stored, w)
    # llama.cpp stores each head's rows as (first-half, second-half) pairs interleaved.
    np.testing.assert_array_equal(stored[:8:2], w[:4])
    np.testing.assert_array_equal(stored[1:8:2], w[4:8])
    np.testing.assert_array_equal(unpermute_rotary_rows(stored, 6), w)


def test_runtime_path_does_not_import_torch(default_model_installed):
    code = textwrap.dedent(
        """
        import sys
        from spec_jax.checkpoints import apply_chat_template, load_target
        model = load_target(None)
        ids = apply_chat_template(model.tokenizer, "Hi")
        assert model.tokenizer.decode(ids).endswith("assistant\\n")
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")

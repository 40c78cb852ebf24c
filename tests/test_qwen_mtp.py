"""The MTP head of Qwen3.5 / Qwen3-Next checkpoints as a drafter (issue 44), on a tiny random
Qwen3.5 target (a Gated DeltaNet layer and a gated attention layer) whose directory gets random
`mtp.*` tensors under vLLM's names (`write_qwen_mtp`):

- `load_drafter("mtp", target, TARGET_DIR)` reads them; the first two chained drafts' logits
  equal a torch reference of vLLM's `qwen3_next_mtp` structure built from transformers' own
  Qwen3.5 layer (the MTP layer is a one-layer Qwen3_5TextModel fed fc(concat[norm(embed),
  norm(hidden)]), as SGLang builds it), read straight from the safetensors (1e-4, float32);
- greedy speculative decoding with it equals plain decoding (a chain of K = 2 at batch 1 and 2;
  its trees are the pair-cache trees EAGLE-3's tree tests cover): its pair cache catches up on
  accepted tokens, the target's recurrent state follows the accepted path;
- a checkpoint without the head (transformers' save_pretrained drops it) is a clear error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import spec_jax  # noqa: E402
from spec_jax.checkpoints.errors import CheckpointError  # noqa: E402
from spec_jax.checkpoints.hf import read_hf_config  # noqa: E402
from spec_jax.checkpoints.qwen_mtp import write_qwen_mtp  # noqa: E402
from spec_jax.drafters.qwen_mtp import QwenMtpConfig, QwenMtpDrafter, mtp_weight_specs  # noqa: E402
from spec_jax.models.weights import is_spec  # noqa: E402
from test_qwen3_5 import TEXT, randomised  # noqa: E402
from tiny_configs import VOCAB  # noqa: E402


def random_mtp_params(cfg: QwenMtpConfig, seed: int):
    """Every weight random (numpy: no compiles), the (1 + w) norms included (zeros would hide a
    missing norm)."""
    rng = np.random.RandomState(seed)
    return jax.tree.map(lambda s: (rng.standard_normal(s.shape) * (0.3 if len(s.shape) == 1 else 0.2)).astype(np.float32),
                        mtp_weight_specs(cfg), is_leaf=is_spec)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the HF target, the directory with the head, the loaded target, drafter, drafter params)."""
    model = randomised(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)), 0)
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    model.save_pretrained(path)
    cfg = QwenMtpConfig.from_target(read_hf_config(path)[1])
    write_qwen_mtp(path, cfg, random_mtp_params(cfg, 3))
    loaded = spec_jax.load_target(path)
    drafter, params = spec_jax.load_drafter("mtp", loaded, str(path), k=2)
    assert isinstance(drafter, QwenMtpDrafter) and drafter.k == 2
    return model, path, loaded, drafter, params


def reference_logits(model, path, prompt: list[int], steps: int) -> np.ndarray:
    """vLLM's structure in torch: pair t = (the target's final-normed hidden state of token t,
    token t + 1) -> fc(concat[pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)]) -> the
    MTP decoder layer at position t over pairs 0..t -> norm -> the target's LM head; each further
    draft appends (the normed output, the draft). -> logits of `steps` chained drafts [steps, V]."""
    from safetensors.torch import load_file

    mtp = {n[len("mtp."):]: t for n, t in load_file(str(path / "mtp.safetensors")).items()}
    layer_cfg = transformers.Qwen3_5TextConfig(**{**TEXT, "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    mtp_model = transformers.Qwen3_5TextModel(layer_cfg).float().eval()
    missing, unexpected = mtp_model.load_state_dict(
        {n: t for n, t in mtp.items() if n.startswith(("layers.", "norm."))}, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    norm_embed, norm_hidden = (transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm(TEXT["hidden_size"])
                               for _ in range(2))
    norm_embed.weight.data, norm_hidden.weight.data = mtp["pre_fc_norm_embedding.weight"], mtp["pre_fc_norm_hidden.weight"]
    with torch.no_grad():
        tokens = torch.tensor([prompt])
        hidden = model.model(tokens).last_hidden_state  # [1, P, H] final-normed
        tokens = torch.cat([tokens, model.lm_head(hidden[:, -1:]).argmax(-1)], dim=1)  # + the first sampled token
        out_logits = []
        for _ in range(steps):
            pairs = hidden.shape[1]
            x = torch.cat([norm_embed(model.model.embed_tokens(tokens[:, 1:])), norm_hidden(hidden)], dim=-1)
            out = mtp_model(inputs_embeds=x @ mtp["fc.weight"].T, position_ids=torch.arange(pairs)[None]).last_hidden_state
            logits = model.lm_head(out[:, -1])
            out_logits.append(logits[0].numpy())
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
            tokens = torch.cat([tokens, logits.argmax(-1)[:, None]], dim=1)
    return np.stack(out_logits)


def test_mtp_head_matches_a_reference_of_vllms_structure(checkpoint):
    model, path, loaded, drafter, params = checkpoint
    target = loaded.target
    prompt = np.random.RandomState(4).randint(0, VOCAB, 9).tolist()
    want = reference_logits(model, path, prompt, steps=2)

    p = len(prompt)

    @jax.jit
    def draft(params, target, prompt_tokens):
        out = target.forward(prompt_tokens, jnp.arange(p)[None], target.model.init_cache(1, 32))
        first = jnp.argmax(target.logits(out.hidden[:, -1]), axis=-1)
        tokens = jnp.zeros((1, 16), jnp.int32).at[:, :p].set(prompt_tokens).at[:, p].set(first)
        state = drafter.init(params, target, prompt_tokens, jnp.asarray([p]), out.hidden, 32)
        logits, _, _ = drafter.draft_logits(params, target, state, tokens, jnp.asarray([p + 1]))
        return logits[0]

    got = np.asarray(draft(params, target, jnp.asarray([prompt])))
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_greedy_speculation_with_the_mtp_head_equals_plain_decoding(checkpoint):
    """Random drafts: rows reject at different depths; a chain of K = 2 at batch 1 and 2. Plain
    decoding is transformers' greedy `generate` of the same target (spec_jax's own plain decoding
    equals it: test_qwen3_5.py), which saves compiling a third loop."""
    model, _, loaded, drafter, params = checkpoint
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, VOCAB, 9).tolist(), rng.randint(0, VOCAB, 5).tolist()]
    new_tokens = 12
    with torch.no_grad():
        plain = [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
                 for p in prompts]
    for rows in (1, 2):
        got = spec_jax.generate(loaded, prompts[:rows], drafter, params, max_new_tokens=new_tokens, capacity=32,
                                ignore_eos=True).generated_ids
        assert got == plain[:rows], rows


def test_a_checkpoint_without_the_head_is_a_clear_error(checkpoint, tmp_path):
    model, _, loaded, _, _ = checkpoint
    model.save_pretrained(tmp_path)  # transformers writes no mtp.* tensors
    with pytest.raises(CheckpointError, match="this checkpoint has no MTP head"):
        spec_jax.load_drafter("mtp", loaded, str(tmp_path))
    # No path: the head is read from the target's own directory (it is loaded from `path`).
    _, path, loaded, drafter, params = checkpoint
    own, own_params = spec_jax.load_drafter("mtp", loaded, k=2)
    assert own == drafter and str(loaded.source) == str(path)
    for a, b in zip(jax.tree_util.tree_leaves(own_params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    headless = spec_jax.load_target(tmp_path)  # a Qwen3.5 directory without the head: the clear error
    with pytest.raises(CheckpointError, match="this checkpoint has no MTP head"):
        spec_jax.load_drafter("mtp", headless)

"""The MTP head of Qwen3.5 / Qwen3-Next checkpoints as a drafter (issue 44), on a tiny random
Qwen3.5 target (a Gated DeltaNet layer and a gated attention layer) whose directory gets random
`mtp.*` tensors under vLLM's names (`write_qwen_mtp`):

- `load_drafter("mtp", target, TARGET_DIR)` reads them; the first two chained drafts' logits
  equal a torch reference of vLLM's `qwen3_next_mtp` structure built from transformers' own
  Qwen3.5 layer (the MTP layer is a one-layer Qwen3_5TextModel fed fc(concat[norm(embed),
  norm(hidden)]), as SGLang builds it), read straight from the safetensors (1e-4, float32);
- `spec-jax train mtp`'s recipe trains the head on a tiny Qwen3.5 target's own greedy answers
  (`learnable`): the loss falls, and on held-out prompts the trained head's drafts are accepted
  more often than the untrained head's, the output equal to plain decoding;
- greedy speculative decoding with the trained head equals plain decoding as a chain and as a
  tree, at batch 1 and 4, with rows accepting different numbers of drafts in the same steps: the
  pair cache catches up on accepted tokens, the target's recurrent state follows the accepted path;
- a checkpoint without the head (transformers' save_pretrained drops it) is a clear error.
"""

from __future__ import annotations

import dataclasses

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
from spec_jax.training.data import TokenDataset  # noqa: E402
from spec_jax.training.mtp import MtpRecipe, train_mtp  # noqa: E402
from spec_jax.training.trainer import TrainConfig  # noqa: E402
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


PROMPT_LEN, ANSWER_LEN, TRAIN_ROWS, HELD_OUT_ROWS = 8, 24, 32, 4
TRAIN = TrainConfig(steps=40, batch_size=8, seq_len=PROMPT_LEN + ANSWER_LEN, learning_rate=1e-2, warmup_steps=1,
                    save_every=40, log_every=1)


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    """A tiny Qwen3.5 target (the TEXT shapes, other weights) whose layers' output projections
    are scaled down 0.15x, so its next token leans on the last one (context still counts): tens of
    training steps then learn something that carries to held-out prompts (at full scale they
    memorise the training answers: held-out tau 1.02). Its head is trained from scratch by the
    `spec-jax train mtp` recipe on its greedy answers to TRAIN_ROWS random prompts; HELD_OUT_ROWS
    more prompts are held out. -> dict: loaded (target), drafter, trained (params read back from
    the export), untrained (the recipe's initial params), losses, prompts [N, P], answers [N, A]:
    transformers' greedy `generate`, the plain decoding the tests compare with (spec_jax's own
    equals it, test_qwen3_5.py; that saves compiling a plain loop)."""
    model = randomised(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)), 6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.mul_(0.15)
    path = tmp_path_factory.mktemp("qwen3_5_learnable")
    model.save_pretrained(path)
    prompts = np.random.RandomState(7).randint(0, VOCAB, (TRAIN_ROWS + HELD_OUT_ROWS, PROMPT_LEN))
    with torch.no_grad():  # equal prompt lengths: one batched greedy generate, no padding
        answers = model.generate(torch.tensor(prompts), max_new_tokens=ANSWER_LEN, do_sample=False)[:, PROMPT_LEN:]
    answers = answers.numpy()
    loaded = spec_jax.load_target(path)
    data = TokenDataset.from_sequences(list(np.concatenate([prompts, answers], 1)[:TRAIN_ROWS]),
                                       [PROMPT_LEN] * TRAIN_ROWS, ["greedy"] * TRAIN_ROWS)
    out = tmp_path_factory.mktemp("mtp_run")
    _, _, result = train_mtp(loaded, data, out, TRAIN, k=2, anchors=8, eval_prompts=0, progress=False)
    drafter, trained = spec_jax.load_drafter("mtp", loaded, str(out / "drafter"), k=2)
    untrained = MtpRecipe.for_target(loaded, k=2, anchors=8).initial_params(loaded, TRAIN.seed, None)
    return dict(loaded=loaded, drafter=drafter, trained=trained, untrained=untrained, prompts=prompts,
                answers=answers, losses=[h["loss"] for h in result.history])


def test_training_the_head_beats_the_untrained_head_on_held_out_prompts(learnable):
    """The recipe's loss falls; on the held-out prompts (batch 4, a chain of K = 2) the trained
    head's tau beats the untrained one's (measured 1.76 against 1.00), both outputs exact."""
    losses = learnable["losses"]
    assert len(losses) == TRAIN.steps and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses
    held_out = learnable["prompts"][TRAIN_ROWS:].tolist()
    plain = learnable["answers"][TRAIN_ROWS:, :16].tolist()
    taus = {}
    for name in ("trained", "untrained"):  # one program: the params are arguments
        r = spec_jax.generate(learnable["loaded"], held_out, learnable["drafter"], learnable[name],
                              max_new_tokens=16, capacity=32, ignore_eos=True)
        assert r.generated_ids == plain, name
        taus[name] = r.stats.tau
    print(f"loss {np.mean(losses[:3]):.2f} -> {np.mean(losses[-5:]):.2f}; held-out tau {taus}")
    assert taus["trained"] > taus["untrained"] + 0.2, taus


def test_mtp_head_chain_and_tree_at_batch_1_and_4_equal_plain_decoding(learnable):
    """The trained head on prompts it learned from (some cut inside their answers: 8-13 tokens)
    accepts often but not always: a chain of K = 2 and a tree of 6 nodes, depth 3, each at batch
    1 and 4, give plain decoding's tokens. At batch 4 the rows' acceptance histograms differ:
    rows step together (every row from the first step until it has its 12 tokens), and rows that
    accepted equally at every step would have equal histograms, so in some step they accepted
    different numbers of drafts (the target rolled its recurrent state back to different depths)."""
    cut = [0, 3, 5, 1]  # answer tokens moved into the prompt, per row
    prompts = [learnable["prompts"][i].tolist() + learnable["answers"][i, :c].tolist() for i, c in enumerate(cut)]
    plain = [learnable["answers"][i, c:c + 12].tolist() for i, c in enumerate(cut)]
    chain = learnable["drafter"]
    tree = dataclasses.replace(chain, k=3, tree=6)
    for drafter, rows in ((chain, 1), (chain, 4), (tree, 1), (tree, 4)):
        r = spec_jax.generate(learnable["loaded"], prompts[:rows], drafter, learnable["trained"], max_new_tokens=12,
                              capacity=32, ignore_eos=True)
        case = f"{'tree' if drafter.tree else 'chain'} at batch {rows}"
        assert r.generated_ids == plain[:rows], case
        histograms = [row.acceptance_histogram for row in r.row_stats]
        print(f"{case}: tau {r.stats.tau:.2f}, per-row acceptance histograms {histograms}")
        assert r.stats.accepted > 0 and r.stats.drafted == (drafter.tree or drafter.k) * r.stats.steps, case
        if rows > 1:
            assert any(h != histograms[0] for h in histograms), (case, histograms)
        if drafter.tree:  # paths deeper than one node
            assert sum(sum(h[2:]) for h in histograms) > 0, (case, histograms)


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

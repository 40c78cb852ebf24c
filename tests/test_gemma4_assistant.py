"""Gemma 4's assistant (`--drafter mtp`): its draft logits (dense and centroid-sparse) and K
chained drafts against transformers' `Gemma4AssistantForCausalLM` given the same target cache
and hidden state; greedy decoding with it (chain and tree, batch 1 and 4, with and without
prompt lookup) token-identical to plain decoding; an oracle that gets every draft accepted only
if the cache view and the chained state are the right ones; the joint of 3 sampled tokens; the
target-interface checks (a target without a cache view is refused by name)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spec_jax.checkpoints.gemma4_assistant import load_gemma4_assistant, save_gemma4_assistant  # noqa: E402
from spec_jax.drafters.gemma4_assistant import Gemma4AssistantDrafter  # noqa: E402
from spec_jax.models.config import FULL_ATTENTION, SLIDING_ATTENTION  # noqa: E402
from spec_jax.models.interface import LayerKV, Target  # noqa: E402

VOCAB, WINDOW, PROMPT_LEN, K = 128, 4, 10, 3


# ------------------------------------------------------------------ parity with transformers
def _hf_pair():
    """A tiny random transformers Gemma 4 target and its assistant (centroid-sparse logits),
    norms, scalars and the token ordering perturbed so a swapped or missing one shows."""
    rope = {SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL_ATTENTION: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    common = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW, rope_parameters=rope)
    # The last two layers reuse the first two's keys/values: the assistant reads layers 0 and 1's.
    # (Per-layer embeddings on, as in E2B/E4B: transformers' generate needs them with KV sharing.)
    target_cfg = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_kv_shared_layers=2, **common,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        layer_types=[SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION])
    text = transformers.Gemma4TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, **common,
                                         layer_types=[SLIDING_ATTENTION, FULL_ATTENTION],
                                         hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    assistant_cfg = transformers.Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=64, use_ordered_embeddings=True, num_centroids=16,
        centroid_intermediate_top_k=4)
    torch.manual_seed(0)
    target = transformers.Gemma4ForCausalLM(target_cfg).eval()
    assistant = transformers.Gemma4AssistantForCausalLM(assistant_cfg).eval()
    with torch.no_grad():
        for name, p in assistant.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif "embed" in name or "centroids" in name:
                p.mul_(8.0)
        for layer in assistant.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(()).item())
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    assistant.generation_config.num_assistant_tokens = K
    return target, assistant


@dataclasses.dataclass(frozen=True)
class HFCacheTarget:
    """transformers' target seen through the interface a drafter reads: its embedding (scaled)
    and the keys/values it shares with the assistant, as the cache of a `CacheReader`."""

    vocab_size: int = VOCAB
    hidden_size: int = 64
    layer_types: tuple[str, ...] = (SLIDING_ATTENTION, FULL_ATTENTION)

    def embed(self, params, tokens):
        return jnp.take(params["embed"], tokens, axis=0) * jnp.float32(math.sqrt(self.hidden_size))

    def cache_view(self, cache, layer):
        k, v = cache[self.layer_types[layer]]
        return LayerKV(k, v, cache["lengths"], 0)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(transformers target, assistant, the assistant's dir); the target's dir is beside it."""
    target, assistant = _hf_pair()
    root = tmp_path_factory.mktemp("gemma4")
    target.save_pretrained(root / "target", safe_serialization=True)
    assistant.save_pretrained(root / "assistant", safe_serialization=True)
    assistant.generation_config.save_pretrained(root / "assistant")
    return target, assistant, root / "assistant"


def test_draft_logits_and_chained_drafts_equal_transformers(hf_pair, tmp_path):
    """Given the same target cache and hidden state (the prompt longer than the window): the
    dense and the centroid-sparse logits of K chained steps equal the assistant's in
    transformers within 1e-4, and the drafts are those of transformers' assisted generation
    (its MTP candidate generator's first round after the prefill)."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    target, assistant, path = hf_pair
    drafter, params = load_gemma4_assistant(path)
    assert drafter.k == K and drafter.cfg.use_ordered_embeddings
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    input_ids = torch.cat([prompt, first], dim=1)

    # transformers: the candidate generator, with the dense head's logits read off a hook.
    dense_hf = []
    hook = assistant.model.register_forward_hook(
        lambda module, args, output: dense_hf.append(assistant.lm_head(output.last_hidden_state)))
    generator = SinglePositionMultiTokenCandidateGenerator(
        assistant, target.get_input_embeddings(), transformers.GenerationConfig(max_length=64))
    with torch.no_grad():
        candidates, sparse_hf = generator.get_candidates(
            input_ids, {"attention_mask": torch.ones_like(input_ids)}, out, is_first_iteration=False, n_last_matches=0)
    hook.remove()
    drafts_hf = candidates[0, input_ids.shape[1]:].tolist()

    # spec_jax: the same keys/values and hidden state through the drafter.
    model = HFCacheTarget()
    cache = {kind: tuple(jnp.asarray(x.numpy()) for x in out.shared_kv_states[kind]) for kind in model.layer_types}
    cache["lengths"] = jnp.asarray([PROMPT_LEN], jnp.int32)
    embed = jnp.asarray(target.get_input_embeddings().weight.detach().numpy())
    view = Target({"embed": embed}, model, cache)
    state = jnp.asarray(out.hidden_states[-1][:, -1].numpy())
    tokens = jnp.zeros((1, 32), jnp.int32).at[0, : PROMPT_LEN + 1].set(jnp.asarray(input_ids[0].numpy()))
    lengths = jnp.asarray([PROMPT_LEN + 1], jnp.int32)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    sparse, drafts = drafter.draft_logits(params, view, state, tokens, lengths)
    assert np.asarray(drafts[0]).tolist() == drafts_hf
    np.testing.assert_allclose(np.asarray(sparse[0]), sparse_hf[0].numpy(), atol=1e-4, rtol=1e-4)
    dense_drafter = Gemma4AssistantDrafter(dataclasses.replace(drafter.cfg, use_ordered_embeddings=False), k=K)
    dense_params = {k: v for k, v in params.items() if k not in ("centroids", "token_ordering")}
    dense, _ = dense_drafter.draft_logits(dense_params, view, state, tokens, lengths, choose=lambda i, _: drafts[:, i])
    np.testing.assert_allclose(np.asarray(dense[0]), torch.cat(dense_hf, 1)[0].numpy(), atol=1e-4, rtol=1e-4)

    # The export loads back in transformers with the same weights.
    save_gemma4_assistant(tmp_path / "export", drafter.cfg, jax.device_get(params))
    back = transformers.Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "export").eval()
    for name, p in assistant.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name].numpy(), p.numpy(), err_msg=name)


# ------------------------------------------------------------------ in the loop
from spec_jax.checkpoints import load_target  # noqa: E402
from spec_jax.checkpoints.shipped import load_drafter  # noqa: E402
from spec_jax.decoding import generate  # noqa: E402
from spec_jax.drafters.gemma4_assistant import Gemma4AssistantConfig, init_assistant_params  # noqa: E402
from spec_jax.models import Decoder, init_params  # noqa: E402
from spec_jax.models.decoder import forward_hidden, init_cache  # noqa: E402

NEW = 24
PROMPTS = {1: [[5, 9, 3, 7, 1, 8, 2, 6, 4]],
           4: [[5, 9, 3, 7, 1, 8, 2, 6, 4], [3, 4, 3, 4, 3, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
               [7, 7, 1]]}


@pytest.fixture(scope="module")
def gemma4(hf_pair):
    """transformers' tiny Gemma 4 loaded by spec_jax, and transformers' greedy continuations of
    the 4 prompts (the first is the batch-1 prompt)."""
    model, _, path = hf_pair
    want = []
    for prompt in PROMPTS[4]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    return load_target(str(path.parent / "target")), {4: want, 1: want[:1]}


@dataclasses.dataclass(frozen=True)
class OracleAssistant(Gemma4AssistantDrafter):
    """An assistant that knows the answer, but finds its place only through what the loop hands
    it: params hold the greedy sequences, the target's keys of its last full layer and its final
    hidden states there. A step matches the last committed key of the cache view (position p - 1
    for a draft at position p) and its input state to positions; its draft is the true next token
    only if the cache view ends at p - 1, the state is position p - 1 + (steps chained so far)'s
    and the input token is the true token after it, else a decoy; the state it passes on is the
    true hidden state one position further. So every draft is accepted only if the view is the
    committed cache and the chained state starts at the right hidden state."""

    def weight_specs(self):
        return None

    def step(self, params, target, tokens, state, position):
        seq, keys, hidden = params["tokens"], params["keys"], params["hidden"]  # [B, S], [B, S, Kv*D], [B, S, Hb]
        rows, t = jnp.arange(seq.shape[0])[:, None], jnp.arange(tokens.shape[1])
        view = target.cache_view(len(target.model.layer_types) - 1)
        last_key = view.k[rows[:, 0], :, view.lengths - 1].reshape(seq.shape[0], 1, -1)  # [B, 1, Kv*D]
        cache_pos = jnp.argmin(jnp.sum((keys - last_key) ** 2, -1), axis=1)  # [B]
        state_pos = jnp.argmin(jnp.sum((hidden[:, None] - state[:, :, None]) ** 2, -1), axis=2)  # [B, T]
        at = lambda offset: seq[rows, jnp.minimum(state_pos + offset, seq.shape[1] - 1)]  # noqa: E731
        right = (cache_pos[:, None] == position[:, None] - 1) & (state_pos >= cache_pos[:, None]) & (tokens == at(1))
        truth, decoy = at(2), (at(2) + 1) % VOCAB
        logits = jnp.full(tokens.shape + (VOCAB,), -6.0)
        logits = logits.at[rows, t, decoy].set(jnp.where(right, -3.0, -0.1))
        logits = logits.at[rows, t, truth].set(jnp.where(right, -0.1, -3.0))
        return logits, hidden[rows, jnp.minimum(state_pos + 1, seq.shape[1] - 1)]


def oracle_params(target, greedy):
    seq = np.zeros((4, 48), np.int32)
    for i, (p, g) in enumerate(zip(PROMPTS[4], greedy)):
        seq[i, : len(p) + len(g)] = p + g
    positions = jnp.broadcast_to(jnp.arange(48), (4, 48))
    out = forward_hidden(target.params, target.cfg, jnp.asarray(seq), positions, init_cache(target.cfg, 4, 48))
    keys = Decoder(target.cfg).cache_view(out.cache, target.cfg.num_layers - 1).k  # [B, Kv, S, D]
    return {"tokens": jnp.asarray(seq), "keys": jnp.swapaxes(keys, 1, 2).reshape(4, 48, -1), "hidden": out.hidden}


# (chain or tree budget, batch, prompt lookup in front, an oracle): a chain at batch 1 and 4, with
# and without the lookup, and the oracle's tree of 16 at batch 4 (each case is a compile of its own;
# a tree behind the lookup at batch 1 passed too, by hand).
LOOP_CASES = [(0, 1, False, False), (0, 4, True, False), (16, 4, False, True)]


def test_greedy_with_the_assistant_equals_plain_decoding_and_an_oracle_gets_all_accepted(hf_pair, gemma4):
    """On transformers' tiny Gemma 4 (KV-shared layers, per-layer embeddings, a window shorter
    than the prompts) loaded by spec_jax, with transformers' assistant loaded through the registry
    (`--drafter mtp=PATH`): greedy decoding equals transformers' greedy generate in every case;
    the oracle's tree has both drafts of every step accepted."""
    target, greedy = gemma4
    path = hf_pair[2]
    for tree, batch, lookup, oracle in LOOP_CASES:
        if oracle:
            drafter, params = OracleAssistant(load_drafter("mtp", target, str(path))[0].cfg, k=2, tree=tree), \
                oracle_params(target, greedy[4])
        else:
            drafter, params = load_drafter("mtp+ngram" if lookup else "mtp", target, str(path), k=2)
            drafter = dataclasses.replace(drafter, tree=tree)
        if lookup:
            drafter = dataclasses.replace(drafter, min_match=1)
        r = generate(target, PROMPTS[batch], drafter, params, max_new_tokens=NEW, ignore_eos=True)
        assert r.generated_ids == greedy[batch], (tree, batch, lookup)
        assert r.stats.drafted == (tree or 2) * r.stats.steps
        if oracle:  # both drafts accepted every step, bar each row's last (drafting past its end)
            assert r.stats.accepted >= 2 * (r.stats.steps - batch), r.stats


# ------------------------------------------------------------------ sampling stays exact
from test_sampling_stats import E2E_CFG, PROMPT, V_E2E, chi_square_ok, e2e, exact_joint  # noqa: E402,F401


def test_sampled_drafts_reproduce_the_target_joint_distribution(e2e):
    """The first 3 tokens at T=0.7 over 5 seeds x 2048 rows against the exact joint: a chain of
    drafts sampled from the assistant's centroid-sparse distribution (half the vocabulary scored,
    the rest at the floor), returned with their probabilities."""
    params, _, logits = e2e
    cfg = Gemma4AssistantConfig(
        vocab_size=V_E2E, hidden_size=16, intermediate_size=32, num_heads=2, layer_types=(FULL_ATTENTION,),
        head_dim=16, num_kv_heads=1, backbone_hidden_size=E2E_CFG.hidden_size, use_ordered_embeddings=True,
        num_centroids=4, centroid_top_k=2)
    drafter = Gemma4AssistantDrafter(cfg, k=2)
    dparams = init_assistant_params(cfg, jax.random.key(15), scale=1.5)
    counts = np.zeros((V_E2E,) * 3)
    accepted = 0
    for seed in range(5):
        r = generate((E2E_CFG, params), [PROMPT] * 2048, drafter, dparams, max_new_tokens=3, temperature=0.7,
                     seed=seed, capacity=32)
        np.add.at(counts, tuple(np.asarray(r.generated_ids).T), 1)
        accepted += r.stats.accepted
    assert accepted > 0
    chi_square_ok(counts, exact_joint(logits, 0.7, 0, 1.0), "Gemma 4 assistant sampled chain joint")


# ------------------------------------------------------------------ the target interface
@dataclasses.dataclass(frozen=True)
class NoCacheView:
    """A target behind the interface without `layer_types` / `cache_view`."""

    inner: Decoder
    vocab_size = property(lambda self: self.inner.vocab_size)
    hidden_size = property(lambda self: self.inner.hidden_size)
    num_layers = property(lambda self: self.inner.num_layers)
    max_positions = property(lambda self: self.inner.max_positions)
    stop_ids = property(lambda self: self.inner.stop_ids)

    def __getattr__(self, name):
        if name in ("init_cache", "cache_lengths", "forward", "logits", "embed", "commit", "weight_specs"):
            return getattr(self.inner, name)
        raise AttributeError(name)


class CopyingView(Decoder):
    def cache_view(self, cache, layer):
        view = super().cache_view(cache, layer)
        return view._replace(k=view.k + 0)


def test_the_cache_view_is_checked_and_targets_are_checked_before_compiling(gemma4, e2e):
    """check_target refuses a view that copies (the decoder's own view passes it in every
    check_target run of the families' tests, Gemma 4's included); the assistant refuses, before
    compiling, a target that offers no view (naming itself) and a target it does not fit (every
    reason at once)."""
    from spec_jax.testing import TargetCheckError, check_target

    target, _ = gemma4
    with pytest.raises(TargetCheckError, match="cache view: cache_view.* returned new arrays"):
        check_target(CopyingView(E2E_CFG), e2e[0])
    drafter = Gemma4AssistantDrafter(ASSISTANT, k=2)
    params = init_assistant_params(ASSISTANT, jax.random.key(1))
    with pytest.raises(ValueError, match=r"Gemma 4 assistant \(--drafter mtp\) reads the target's cache .* "
                                         r"NoCacheView does not offer it"):
        generate((NoCacheView(Decoder(target.cfg)), target.params), PROMPTS[1], drafter, params, max_new_tokens=2)
    llama = E2E_CFG.replace(vocab_size=100)
    with pytest.raises(ValueError, match=r"does not fit this target: its vocabulary \(128 tokens\) differs .*; it was "
                                         r"made for a 64-wide target .*; it reads \['sliding_attention'\] layers .*"
                                         r"its layer 1 reads 1 KV heads of size 32 .* which has 1 of size 16"):
        generate((llama, init_params(llama, jax.random.key(0))), [[1, 2]], drafter, params, max_new_tokens=2)


# An assistant with the tiny target's shapes (random weights) for the refusal checks.
ASSISTANT = Gemma4AssistantConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=4, layer_types=(SLIDING_ATTENTION, FULL_ATTENTION),
    head_dim=16, num_kv_heads=2, global_head_dim=32, num_global_kv_heads=1, backbone_hidden_size=64,
    sliding_window=WINDOW, use_ordered_embeddings=True, num_centroids=16, centroid_top_k=4,
)

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
                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW,
                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, rope_parameters=rope)
    target_cfg = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, **common,
        layer_types=[SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION])
    text = transformers.Gemma4TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, **common,
                                         layer_types=[SLIDING_ATTENTION, FULL_ATTENTION])
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
    target, assistant = _hf_pair()
    path = tmp_path_factory.mktemp("assistant") / "assistant"
    assistant.save_pretrained(path, safe_serialization=True)
    assistant.generation_config.save_pretrained(path)
    return target, assistant, path


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


# ------------------------------------------------------------------ in the loop (spec_jax targets)
from spec_jax.decoding import generate  # noqa: E402
from spec_jax.drafters.gemma4_assistant import Gemma4AssistantConfig, init_assistant_params  # noqa: E402
from spec_jax.drafters.lookup import LookupFirstDrafter  # noqa: E402
from spec_jax.models import Decoder, ModelConfig, init_params  # noqa: E402
from spec_jax.models.decoder import forward_hidden, init_cache  # noqa: E402

# A tiny Gemma 3 (a sliding layer with a window shorter than the prompts, then a full layer) and
# an assistant reading both (centroid-sparse logits).
GEMMA3 = ModelConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, architecture="gemma3", norm_offset=1.0, sandwich_norms=True, mlp_activation="gelu_tanh",
    scale_embeddings=True, query_pre_attn_scalar=24, qk_norm=True, sliding_window=5,
    layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), sliding_rope_theta=1000.0, rms_norm_eps=1e-6,
)
ASSISTANT = Gemma4AssistantConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=4, layer_types=(SLIDING_ATTENTION, FULL_ATTENTION),
    head_dim=16, num_kv_heads=2, backbone_hidden_size=64, sliding_window=5, use_ordered_embeddings=True,
    num_centroids=16, centroid_top_k=4,
)
NEW = 24
PROMPTS = {1: [[5, 9, 3, 7, 1, 8, 2, 6, 4]],
           4: [[5, 9, 3, 7, 1, 8, 2, 6, 4], [3, 4, 3, 4, 3, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
               [7, 7, 1]]}


@pytest.fixture(scope="module")
def gemma3():
    return GEMMA3, init_params(GEMMA3, jax.random.key(0), scale=3.0)


@pytest.fixture(scope="module")
def ar(gemma3):
    """Plain decoding of the 4 prompts; the first row is the batch-1 prompt's (rows are independent)."""
    r = generate(gemma3, PROMPTS[4], max_new_tokens=NEW, ignore_eos=True)
    return {4: r.generated_ids, 1: r.generated_ids[:1]}


@dataclasses.dataclass(frozen=True)
class OracleAssistant(Gemma4AssistantDrafter):
    """An assistant that knows the answer, but finds its place only through what the loop hands
    it: params hold the AR sequences, the target's keys of its full layer and its final hidden
    states there. A step matches the last key of the cache view (slot lengths - 1 of the view,
    i.e. position p - 1) and its input state to positions; its draft is the true next token only
    if the state is the one of position p - 1 + (steps chained so far) and the input token is the
    true token after it, else a decoy; the state it passes on is the true hidden state one
    position further. So every draft is accepted only if the cache view is the committed one and
    the chained state starts at the right hidden state."""

    def weight_specs(self):
        return None

    def step(self, params, target, tokens, state, position):
        seq, keys, hidden = params["tokens"], params["keys"], params["hidden"]  # [B, S], [B, S, Kv*D], [B, S, Hb]
        rows, t = jnp.arange(seq.shape[0])[:, None], jnp.arange(tokens.shape[1])
        view = target.cache_view(1)
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


def oracle_params(gemma3, ar):
    cfg, target_params = gemma3
    seq = np.zeros((4, 48), np.int32)
    for i, (p, g) in enumerate(zip(PROMPTS[4], ar[4])):
        seq[i, : len(p) + len(g)] = p + g
    positions = jnp.broadcast_to(jnp.arange(48), (4, 48))
    out = forward_hidden(target_params, cfg, jnp.asarray(seq), positions, init_cache(cfg, 4, 48))
    keys = jnp.swapaxes(out.cache.k[1], 1, 2).reshape(4, 48, -1)  # the full layer's, by position
    return {"tokens": jnp.asarray(seq), "keys": keys, "hidden": out.hidden}


# (chain or tree budget, batch, prompt lookup in front, an oracle): chain and tree each meet both
# batch sizes, with and without the lookup; the oracle's tree must have every draft accepted.
LOOP_CASES = [(0, 1, False, False), (0, 4, True, False), (16, 1, True, False), (16, 4, False, True)]


def test_greedy_with_the_assistant_equals_plain_decoding_and_an_oracle_gets_all_accepted(gemma3, ar):
    params = init_assistant_params(ASSISTANT, jax.random.key(1), scale=2.0)
    for tree, batch, lookup, oracle in LOOP_CASES:
        drafter = (OracleAssistant if oracle else Gemma4AssistantDrafter)(ASSISTANT, k=2, tree=tree)
        if lookup:
            drafter = LookupFirstDrafter(drafter, min_match=1)
        r = generate(gemma3, PROMPTS[batch], drafter, oracle_params(gemma3, ar) if oracle else params,
                     max_new_tokens=NEW, ignore_eos=True)
        assert r.generated_ids == ar[batch], (tree, batch, lookup)
        assert r.stats.drafted == (tree or 2) * r.stats.steps
        if oracle:  # both drafts accepted every step, bar each row's last (drafting past its end)
            assert r.stats.accepted >= 2 * (r.stats.steps - batch), r.stats

"""Shared helpers for the EAGLE-3 tests: reference drafters from `speculators`, their TTT logits,
target features, and the original (EAGLE repo) checkpoint layout.

Conventions (read from speculators 0.9.0 and checked by the helpers below):

* Vocabulary maps (speculators `train/vocab_mapping.py`, vLLM's llama_eagle3 loader):
  `d2t` is int64 [draft_vocab] holding offsets, ``target_id = draft_id + d2t[draft_id]``;
  `t2d` is bool [target_vocab], True for the target ids that are in the draft vocabulary.
  The draft ids are the kept target ids in increasing order, and `lm_head` row i scores draft id i.
  With a full vocabulary (draft_vocab == target_vocab) speculators keeps both buffers as None and
  does not save them: read that as the identity (`vocab_maps` returns it).
* Features (vLLM / speculators data generation): aux layer id i is the input of decoder layer i,
  which is HF ``hidden_states[i]``. Position t of `aux_hidden` holds the target features of token t,
  `input_ids` position t holds token t+1, and positions default to ``1 + arange(T)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dflash_testlib import VOCAB, make_target  # noqa: F401  (make_target is re-exported)

torch.set_num_threads(1)

DRAFT_INTERMEDIATE = 96
ALWAYS_IN_DRAFT_VOCAB = (0, 1, 2, VOCAB - 1)


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def _draft_vocab(draft_vocab_size: int, seed: int, always=ALWAYS_IN_DRAFT_VOCAB):
    """(d2t int64 [draft], t2d bool [VOCAB]) for a seeded sorted subset of target ids."""
    rng = np.random.default_rng(seed)
    always = sorted(set(always))
    rest = np.setdiff1d(np.arange(VOCAB), always)
    picked = rng.choice(rest, size=draft_vocab_size - len(always), replace=False)
    ids = np.sort(np.concatenate([always, picked]))
    d2t = torch.from_numpy(ids - np.arange(draft_vocab_size)).to(torch.long)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    return d2t, t2d


def vocab_maps(model) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) as numpy, the identity when the model keeps the full vocabulary (buffers None)."""
    if model.d2t is None:
        return np.zeros(model.draft_vocab_size, np.int64), np.ones(model.verifier_vocab_size, bool)
    return model.d2t.numpy().astype(np.int64), model.t2d.numpy().astype(bool)


def draft_to_target_ids(model) -> np.ndarray:
    """int64 [draft_vocab]: the target id of each draft id (``arange + d2t``)."""
    d2t, _ = vocab_maps(model)
    return np.arange(len(d2t)) + d2t


def make_reference_eagle3(
    target_model,
    *,
    kind: str,
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    aux_layer_ids=(2, 3, 5),
    seed: int = 0,
    norm_before_residual: bool = False,
    norm_output: bool = False,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    verifier_name_or_path: str | None = None,
):
    """A random speculators `Eagle3DraftModel` (eval, float32) for the tiny torch target.

    `kind` ("llama" / "qwen3") picks the drafter's decoder layers. Eager attention with the dense
    float masks speculators builds for it, so everything runs on CPU. The verifier is described by
    `verifier_name_or_path` (default None): with None, neither construction nor
    `Eagle3DraftModel.from_pretrained` reads anything about the verifier (no hub access).
    """
    import transformers
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tc = target_model.config
    layer_kwargs = dict(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=DRAFT_INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=_rope_theta(tc),
        max_position_embeddings=tc.max_position_embeddings,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        layer_config = transformers.Qwen3Config(**layer_kwargs)
    elif kind == "llama":
        layer_config = transformers.LlamaConfig(**layer_kwargs)
    else:
        raise ValueError(f"unknown drafter kind {kind!r}")
    layer_config._attn_implementation = "eager"

    draft_vocab_size = draft_vocab_size or tc.vocab_size
    verifier = VerifierConfig(
        name_or_path=verifier_name_or_path,
        architectures=list(tc.architectures or [type(target_model).__name__]),
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        norm_output=norm_output,
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=verifier,
        ),
    )
    model = Eagle3DraftModel(config)

    if draft_vocab_size < tc.vocab_size:
        d2t, t2d = _draft_vocab(draft_vocab_size, seed)
        model.load_vocab_mappings(t2d, d2t)
        kept = torch.from_numpy(draft_to_target_ids(model))
    else:
        kept = torch.arange(tc.vocab_size)

    torch.manual_seed(seed)
    target_head = target_model.lm_head.weight.detach()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight":
                p.copy_(target_model.get_input_embeddings().weight)
            elif name == "lm_head.weight":
                p.normal_(0.0, 3.0 / np.sqrt(p.shape[1]))
            elif name == "verifier_lm_head.weight":  # what load_verifier_weights would set
                p.copy_(target_head[kept])
            elif name == "verifier_norm.weight":
                p.copy_(target_model.model.norm.weight)
            elif p.ndim == 2:
                p.normal_(0.0, 1.5 / np.sqrt(p.shape[1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.float().eval()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    return model


def load_reference_eagle3(directory):
    """`Eagle3DraftModel.from_pretrained(directory)` (eval, float32) without the verifier step.

    speculators' from_pretrained ends with `load_verifier_weights`, which with a verifier
    `name_or_path` of None still calls ``AutoConfig.from_pretrained(None)`` (and imports loguru,
    not installed here). Every weight the forward uses is in the checkpoint, so that step is
    skipped; only verifier_lm_head / verifier_norm (training targets, never saved) stay unset.
    The attention implementation is not saved and would come back as flex attention, whose
    block masks break for short sequences on CPU: it is set back to eager.
    """
    from unittest import mock

    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(directory))
    config.transformer_layer_config._attn_implementation = "eager"
    with mock.patch.object(Eagle3DraftModel, "load_verifier_weights", lambda self: None):
        model = Eagle3DraftModel.from_pretrained(str(directory), config=config)
    assert model._attn_impl == "eager"
    return model.float().eval()


def reference_step_logits(model, aux_hidden, input_ids, ttt_steps: int) -> list[np.ndarray]:
    """The draft logits [T, draft_vocab] (float32) of each TTT step of the reference forward.

    `aux_hidden` [1, T, 3*H] and `input_ids` [1, T] are already shifted (module docstring);
    one document, default positions. Step s is teacher-forced: it embeds ``input_ids[t + s]``
    (0 past the end), not the previous step's argmax, with positions ``1 + t + s``; its query t
    attends to step-0 keys 0..t and to key t of each later step up to s.
    """
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        with torch.no_grad():
            model(
                hidden_states=torch.as_tensor(aux_hidden, dtype=torch.float32),
                input_ids=torch.as_tensor(input_ids, dtype=torch.long),
                document_ids=torch.zeros_like(torch.as_tensor(input_ids, dtype=torch.long)),
                ttt_steps=ttt_steps,
            )
    finally:
        hook.remove()
    assert len(captured) == ttt_steps
    return [c[0].float().numpy() for c in captured]


def reference_features(target_model, sequence, aux_layer_ids) -> torch.Tensor:
    """[1, T, len(ids)*H]: HF ``hidden_states[i]`` (the input of decoder layer i) per aux id.

    An id equal to the layer count would be HF's last entry, which is *after* the final norm,
    while vLLM captures the last layer's output before it; the tests only use ids < layer count.
    """
    ids = torch.as_tensor(sequence, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    with torch.no_grad():
        out = target_model(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)


def save_original_eagle3_layout(model, directory, target_config) -> None:
    """Write `model` as an original EAGLE-3 head (``LlamaForCausalLMEagle3``, ``midlayer.*``).

    That layout has one llama-style layer (no q_norm/k_norm) and 3 aux features; d2t/t2d are
    always written (identity for a full vocabulary), and embed_tokens.weight is included.
    """
    from safetensors.torch import save_file

    tl = model.config.transformer_layer_config
    if tl.num_hidden_layers != 1:
        raise ValueError("the original EAGLE-3 layout holds exactly one layer")
    if hasattr(model.layers[0].self_attn, "q_norm"):
        raise ValueError("the original EAGLE-3 layout is llama-only (no q_norm/k_norm): use kind='llama'")
    if model.input_norm is not None or model.fc_norm is not None:
        raise ValueError("norm_before_fc / fc_norm have no place in the original layout")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.startswith(("verifier_", "d2t", "t2d")) or t is None:
            continue
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        tensors[name] = t.detach().to(torch.float32).contiguous().clone()
    d2t, t2d = vocab_maps(model)
    tensors["d2t"] = torch.from_numpy(d2t)
    tensors["t2d"] = torch.from_numpy(t2d)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": tl.hidden_size,
        "intermediate_size": tl.intermediate_size,
        "num_attention_heads": tl.num_attention_heads,
        "num_key_value_heads": tl.num_key_value_heads,
        "num_hidden_layers": 1,
        "head_dim": tl.head_dim,
        "rms_norm_eps": tl.rms_norm_eps,
        "rope_theta": _rope_theta(tl),
        "max_position_embeddings": tl.max_position_embeddings,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": model.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")

"""`spec-jax info`: parameter counts and KV-cache bytes per token of a target and a drafter; for a
mixture-of-experts target also the parameters one token runs through and the weight bytes one
decode step reads (the routed experts only)."""

from __future__ import annotations

import argparse
from typing import Any

from spec_jax.app import inputs
from spec_jax.app.common import add_drafter_arg, add_target_args, drafter_spec_from_args

HELP = "parameter counts (total, active per token), bytes per decode step, KV-cache bytes per token"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    add_drafter_arg(p, "Default: none.")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    import jax.numpy as jnp

    from spec_jax.models.moe import param_counts
    from spec_jax.models.weights import count_params, model_weight_specs

    spec = drafter_spec_from_args(args) if args.drafter else inputs.DrafterSpec("none")
    target = _load_target(args.target, args.dtype)
    cfg = target.cfg
    info: dict[str, Any] = {
        "target": {
            "source": target.source,
            "architecture": cfg.architecture,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "tied_embeddings": cfg.tie_embeddings,
            "dtype": cfg.dtype,
            "params": count_params(model_weight_specs(cfg)),
            # A MoE target: every weight but the experts, plus k experts per MoE layer; a step at
            # batch 1 reads those (the embedding table counted whole, as published totals do).
            "active_params_per_token": int(param_counts(cfg)["active"]),
            "weight_bytes_per_step": int(param_counts(cfg)["active"]) * jnp.dtype(cfg.dtype).itemsize,
            "kv_bytes_per_token": cfg.kv_bytes_per_token,
            "has_tokenizer": target.tokenizer is not None,
            "has_chat_template": target.chat_template is not None,
        }
    }
    drafter, _ = inputs.build_drafter(spec, target)
    if drafter is not None:
        info["drafter"] = drafter_info(drafter) | ({"source": spec.path} if spec.path else {})
    if args.json:
        return info
    for section, values in info.items():
        print(f"{section}:")
        for key, value in values.items():
            if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
                value = f"{value:,}"
            print(f"  {key:24s} {value}")
    return None


def _load_target(spec: str | None, dtype: str | None) -> Any:
    """The target, except that a `random:PRESET` one is its shapes alone (`jax.eval_shape`): info
    reads no weight, and a 30B preset's random weights would not fit in memory."""
    from spec_jax.checkpoints import RANDOM_PREFIX, CheckpointError, LoadedModel

    if not (spec or "").startswith(RANDOM_PREFIX):
        return inputs.load_target_or_fail(spec, dtype, untie_head=False)  # the checkpoint as published
    import jax

    from spec_jax.models.decoder import init_params
    from spec_jax.models.presets import preset_config

    try:
        cfg = preset_config(spec[len(RANDOM_PREFIX):], inputs.resolve_dtype(dtype))
    except ValueError as e:
        raise CheckpointError(f"{e} Pass --target random:<preset>.") from None
    params = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
    return LoadedModel(cfg, params, None, None, spec)


def drafter_info(drafter: Any) -> dict[str, Any]:
    """What `info` shows of any drafter, from the protocol alone: its weights come from its own
    `weight_specs()`, so a new drafter shows here without a change to this function."""
    from spec_jax.models.weights import count_params

    specs = drafter.weight_specs()
    cfg = getattr(drafter, "cfg", None)
    draft_vocab = getattr(cfg, "draft_vocab_size", None)
    return {
        "kind": type(drafter).__name__,
        "k": int(drafter.k),
        "params": 0 if specs is None else count_params(specs),
        "capture_layers": list(drafter.capture_layers),
        # Per-token cache of drafters that keep one (draft model, DFlash context); n-gram keeps none.
        "kv_bytes_per_token": int(getattr(cfg, "kv_bytes_per_token", 0)),
        # Rows of a drafter's own draft-vocabulary LM head (EAGLE-3; DFlash with a reduced
        # vocabulary), shown only for drafters that have one.
        **({"draft_vocab_size": int(draft_vocab)} if draft_vocab else {}),
    }

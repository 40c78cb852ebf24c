"""What users pass as a target -> a `TargetModel` / `Target` of the interface.

Kept apart from `spec_jax.models.interface` (the contract, which names no implementation) because
it knows the built-in one: a bare `ModelConfig` means the built-in `Decoder`.
"""

from __future__ import annotations

from typing import Any

from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import Decoder
from spec_jax.models.interface import Target, TargetModel


def as_target_model(model: Any) -> TargetModel:
    """A TargetModel as is; the built-in decoder's `ModelConfig` wrapped in `Decoder`."""
    if isinstance(model, ModelConfig):
        return Decoder(model)
    if not isinstance(model, TargetModel):
        raise TypeError(
            f"{type(model).__name__} is not a target model: implement spec_jax.models.TargetModel "
            "(see docs/bring_your_own_model.md) or pass a built-in ModelConfig."
        )
    return model


def resolve_target(target: Any) -> tuple[Target, tuple[int, ...] | None]:
    """What `generate` and the CLI accept as a target -> (Target, its own stop ids or None).

    A `Target`; anything with a `.target` (a loaded checkpoint: its `stop_ids` include the chat
    template's end of turn); or a `(model, params)` tuple where model is a TargetModel or a
    built-in `ModelConfig`."""
    own_stop = getattr(target, "stop_ids", None)
    if isinstance(target, Target):
        return target, None
    inner = getattr(target, "target", None)
    if isinstance(inner, Target):
        return inner, tuple(own_stop) if own_stop is not None else None
    if isinstance(target, tuple) and len(target) == 2:
        model, params = target
        if isinstance(model, (ModelConfig, TargetModel)):
            return Target(params, as_target_model(model)), None
    raise TypeError(
        f"Not a target: {type(target).__name__}. Pass a loaded model (spec_jax.load_target), a "
        "spec_jax.models.Target(params, model), or a (model, params) tuple whose model implements "
        "spec_jax.models.TargetModel (see docs/bring_your_own_model.md)."
    )

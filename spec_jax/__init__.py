"""spec_jax: speculative decoding for JAX/Flax language models.

    import spec_jax
    target = spec_jax.load_target(None)                      # the embedded default model
    prompt = spec_jax.apply_chat_template(target.tokenizer, "Hi!", target.chat_template)
    out = spec_jax.generate(target, [prompt], spec_jax.NGramDrafter(k=4), max_new_tokens=64)
"""

from spec_jax.checkpoints import LoadedModel, apply_chat_template, load_target
from spec_jax.checkpoints.dflash import load_dflash, save_dflash
from spec_jax.checkpoints.shipped import default_drafter, load_drafter
from spec_jax.decoding import GenerationResult, generate
from spec_jax.drafters.base import Drafter
from spec_jax.drafters.dflash import DFlashConfig, DFlashDrafter
from spec_jax.drafters.draft_model import DraftModelDrafter, self_drafter
from spec_jax.drafters.lookup import LookupFirstDrafter
from spec_jax.drafters.ngram import NGramDrafter

__version__ = "0.1.0"

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "DraftModelDrafter",
    "Drafter",
    "GenerationResult",
    "LoadedModel",
    "LookupFirstDrafter",
    "NGramDrafter",
    "apply_chat_template",
    "default_drafter",
    "generate",
    "load_dflash",
    "load_drafter",
    "load_target",
    "save_dflash",
    "self_drafter",
]

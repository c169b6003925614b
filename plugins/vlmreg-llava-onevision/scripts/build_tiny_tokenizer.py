"""Build the tiny LLaVA-OneVision tokenizer asset shipped in ``vlmreg_llava_onevision/tiny_processor/``.

A maintainer runs this when the asset must change; nothing runs it at import time::

    python plugins/vlmreg-llava-onevision/scripts/build_tiny_tokenizer.py

The llava-hf OneVision checkpoints carry Qwen2's byte-level BPE tokenizer plus two added tokens, ``<image>`` and
``<video>`` (ids 151646 and 151647 there), named as ``image_token`` / ``video_token`` for the processor; turns are
ChatML (``<|im_start|>`` ... ``<|im_end|>``). This script builds a tokenizer of the same kind at toy size: a
byte-level BPE (vocabulary capped at 640) with Qwen2's split pattern, trained on a deterministic generated corpus of
the words the bundled tasks and the conformance checks use, the special tokens at fixed ids 0..4. A rebuild gives
the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "src" / "vlmreg_llava_onevision" / "tiny_processor"

#: Special tokens, at ids 0..4 in this order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
#: What LlavaOnevisionProcessor reads off the tokenizer.
NAMED_TOKENS = {"image_token": "<image>", "video_token": "<video>"}
MAX_VOCAB = 640
#: Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 - one regex (GPT-2's pre-tokenizer)
#: Each must encode to a single token (the colour task's answers and the roles).
ONE_TOKEN = ("Red", "Green", "Blue", "red", "user", "assistant", "system")

VOCABULARY = [
    "what",
    "which",
    "how",
    "many",
    "is",
    "are",
    "the",
    "a",
    "an",
    "of",
    "in",
    "on",
    "to",
    "and",
    "or",
    "this",
    "that",
    "there",
    "image",
    "picture",
    "photo",
    "shape",
    "shapes",
    "colour",
    "color",
    "red",
    "green",
    "blue",
    "yellow",
    "orange",
    "purple",
    "black",
    "white",
    "grey",
    "circle",
    "square",
    "triangle",
    "star",
    "answer",
    "question",
    "number",
    "count",
    "put",
    "boxed",
    "word",
    "only",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "yes",
    "no",
    "left",
    "right",
    "top",
    "bottom",
    "please",
    "shown",
    "user",
    "assistant",
    "system",
    "Red",
    "Green",
    "Blue",
    "What",
    "How",
    "Which",
    "Answer",
    "Count",
    "The",
    "Is",
    "Put",
]
TEMPLATES = (
    "What colour is the shape? Red, Green or Blue?",
    "what colour is the image ?",
    "How many shapes are there? Put the number in \\boxed{{{n}}}.",
    "The answer is {w}.",
    "{C}",
    "{C}.",
)


def corpus(lines: int = 5000, seed: int = 1):
    rng = random.Random(seed)
    for _ in range(lines):
        word = rng.choice(VOCABULARY)
        yield rng.choice(TEMPLATES).format(w=word, C=rng.choice(("Red", "Green", "Blue")), n=rng.randint(0, 30))
        yield " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(2, 9))) + rng.choice((".", "?", "!", ",", ":"))
        yield f"<|im_start|>{rng.choice(('user', 'assistant', 'system'))}\n{word}<|im_end|>\n"


def build() -> None:
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    ids = [backend.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise SystemExit(f"special tokens got ids {ids}, not 0..{len(SPECIAL_TOKENS) - 1}")
    for word in ONE_TOKEN:
        if len(backend.encode(word).ids) != 1:
            raise SystemExit(f"{word!r} does not encode to one token; put it in the corpus more often")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=NAMED_TOKENS,
        model_max_length=4096,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(OUT)
    for stray in ("special_tokens_map.json", "chat_template.jinja"):
        (OUT / stray).unlink(missing_ok=True)
    print(f"wrote {OUT}: {len(tokenizer)} tokens, files {sorted(p.name for p in OUT.iterdir())}")
    print(json.dumps(json.loads((OUT / "tokenizer_config.json").read_text()), indent=1))


if __name__ == "__main__":
    build()

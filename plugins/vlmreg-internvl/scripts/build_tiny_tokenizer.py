"""Build the tiny InternVL tokenizer asset shipped in ``vlmreg_internvl/tiny_processor/``.

Run by a maintainer when the asset must change, never at import time::

    python plugins/vlmreg-internvl/scripts/build_tiny_tokenizer.py

InternVL3's ``-hf`` checkpoints use Qwen2.5's byte-level BPE tokenizer with InternVL's own tokens added
(``<img>``, ``</img>``, ``<IMG_CONTEXT>``, the grounding tokens) and name three of them in
``extra_special_tokens`` so ``InternVLProcessor`` can find them. This script makes the same kind of tokenizer,
small: a byte-level BPE of at most 1024 entries (this corpus gives 544) with Qwen's split pattern, trained on a
generated corpus of the words the bundled tasks and the conformance checks use, with the special tokens at fixed
ids 0-12. The corpus is deterministic, so a rebuild gives the same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "src" / "vlmreg_internvl" / "tiny_processor"

#: The special tokens, at ids 0..12 in this order.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
)
#: What InternVLProcessor reads off the tokenizer (``tokenizer.start_image_token`` and its id, ...).
NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
VOCAB_SIZE = 1024
#: Qwen2's pre-tokenizer split (digits one at a time).
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 - one regex (GPT-2's pre-tokenizer)
#: Must come out as one token each (the colour task's answers, as the model writes them after "assistant\n").
SINGLE_TOKENS = ("Red", "Green", "Blue", "user", "assistant", "system")

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "this",
    "that",
    "what",
    "which",
    "how",
    "many",
    "are",
    "there",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "red",
    "green",
    "blue",
    "yellow",
    "orange",
    "purple",
    "black",
    "white",
    "grey",
    "gray",
    "colour",
    "color",
    "shape",
    "shapes",
    "circle",
    "square",
    "triangle",
    "star",
    "image",
    "picture",
    "answer",
    "question",
    "number",
    "count",
    "put",
    "boxed",
    "word",
    "only",
    "please",
    "yes",
    "no",
    "or",
    "and",
    "shown",
    "left",
    "right",
    "top",
    "bottom",
    "user",
    "assistant",
    "system",
    "Red",
    "Green",
    "Blue",
    "What",
    "How",
    "Which",
    "Put",
    "Answer",
    "Count",
    "The",
    "Is",
]
SENTENCES = (
    "What colour is the shape? Red, Green or Blue?",
    "what colour is the image ?",
    "How many shapes are there? Put the number in \\boxed{{{n}}}.",
    "The answer is {w}.",
    "{W}",
    "{W}.",
)


def corpus(lines: int = 6000, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(lines):
        w = rng.choice(WORDS)
        yield rng.choice(SENTENCES).format(w=w, W=rng.choice(("Red", "Green", "Blue")), n=rng.randint(0, 20))
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + rng.choice((".", "?", "!", ",", ":"))
        yield f"{rng.choice(SPECIAL_TOKENS[1:3])}{rng.choice(('user', 'assistant', 'system'))}\n{w}"


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
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    if [backend.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise SystemExit("the special tokens did not get ids 0..12")
    for word in SINGLE_TOKENS:
        if len(backend.encode(word).ids) != 1:
            raise SystemExit(f"{word!r} is not one token; add it to the corpus")
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
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (OUT / extra).unlink(missing_ok=True)
    print(f"wrote {OUT}: vocab {backend.get_vocab_size()}, files {sorted(p.name for p in OUT.iterdir())}")
    print(json.dumps(json.loads((OUT / "tokenizer_config.json").read_text()), indent=1))


if __name__ == "__main__":
    build()

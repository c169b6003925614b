"""Build the tiny Qwen-style processor asset shipped in ``vlmreg_qwen_common/tiny_processor``.

Run once by a maintainer (never at import time): ``python scripts/build_tiny_tokenizer.py``.
It trains a 1024-entry byte-level BPE on a small generated English corpus, with the Qwen special
tokens at fixed ids 0..8 (the tiny configs use image 5, video 6, vision start 3, vision end 4), wraps
it in ``Qwen2Tokenizer`` and saves tokenizer, chat template and image-processor settings together.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vlmreg_qwen_common.processor import TinyQwenProcessor

SPECIAL_TOKENS = [
    "<|endoftext|>",  # 0
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2
    "<|vision_start|>",  # 3
    "<|vision_end|>",  # 4
    "<|image_pad|>",  # 5
    "<|video_pad|>",  # 6
    "<think>",  # 7
    "</think>",  # 8
]
VOCAB_SIZE = 1024
PRETOKENIZE = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 - one regex (GPT-2's pre-tokenizer)

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
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "be",
    "are",
    "from",
    "or",
    "have",
    "not",
    "but",
    "what",
    "which",
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
    "zero",
    "many",
    "how",
    "much",
    "more",
    "less",
    "than",
    "most",
    "least",
    "each",
    "red",
    "green",
    "blue",
    "yellow",
    "orange",
    "purple",
    "black",
    "white",
    "gray",
    "brown",
    "pink",
    "cyan",
    "colour",
    "color",
    "shape",
    "shapes",
    "circle",
    "square",
    "triangle",
    "star",
    "diamond",
    "rectangle",
    "hexagon",
    "line",
    "point",
    "angle",
    "side",
    "area",
    "length",
    "width",
    "height",
    "count",
    "number",
    "numbers",
    "answer",
    "question",
    "image",
    "picture",
    "diagram",
    "shown",
    "show",
    "below",
    "above",
    "left",
    "right",
    "top",
    "bottom",
    "center",
    "middle",
    "inside",
    "outside",
    "small",
    "large",
    "big",
    "tiny",
    "there",
    "here",
    "where",
    "which",
    "choose",
    "option",
    "options",
    "choice",
    "final",
    "box",
    "boxed",
    "think",
    "thinking",
    "reason",
    "step",
    "steps",
    "solve",
    "find",
    "compute",
    "value",
    "equal",
    "equals",
    "sum",
    "total",
    "degrees",
    "radius",
    "diameter",
    "perimeter",
    "triangle",
    "parallel",
    "perpendicular",
    "segment",
    "measure",
    "unit",
    "units",
    "user",
    "assistant",
    "system",
    "you",
    "your",
    "please",
    "only",
    "word",
    "words",
    "letter",
    "letters",
    "sentence",
    "reply",
    "respond",
    "format",
    "yes",
    "no",
    "true",
    "false",
    "correct",
    "wrong",
    "game",
    "move",
    "screen",
    "next",
    "previous",
    "turn",
    "action",
    "observation",
    "state",
]
TEMPLATES = [
    "What is the {w} of the {v} in the image?",
    "How many {w} shapes are there? Answer with a number.",
    "Choose one of: {w}, {v}, {u}. Answer with one word.",
    "The answer is \\boxed{{{n}}}.",
    "<think>The {w} is {v}, so the answer is {n}.</think>",
    "Count the {w} {v}s: {n} + {m} = {k}.",
    "Step {n}: the {w} {v} has area {k} and perimeter {m}.",
]


def corpus(lines: int = 20000, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(lines):
        template = rng.choice(TEMPLATES)
        n, m = rng.randint(0, 99), rng.randint(0, 99)
        yield template.format(w=rng.choice(WORDS), v=rng.choice(WORDS), u=rng.choice(WORDS), n=n, m=m, k=n + m)
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + rng.choice(".?!,:")


CHAT_TEMPLATE = """\
{%- for message in messages -%}
{{ '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['content'] is string -%}{{ message['content'] }}
{%- else -%}{%- for part in message['content'] -%}
{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- endif -%}{%- endfor -%}{%- endif -%}
{{ '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}
{#- Thinking as in Qwen3.5: enable_thinking false adds an empty closed think block, any other value opens one; unset adds nothing, as Qwen3-VL Instruct -#}
{%- if enable_thinking is defined -%}{{ '<think>\\n\\n</think>\\n\\n' if enable_thinking is false else '<think>\\n' }}{%- endif -%}
{%- endif -%}
"""  # noqa: E501 - the template's lines as the shipped asset has them


def main(out: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.get_vocab_size() <= VOCAB_SIZE

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=4096,
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
    )
    processor = TinyQwenProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    print(f"wrote {out}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main(Path(__file__).resolve().parents[1] / "src" / "vlmreg_qwen_common" / "tiny_processor")

"""Idefics3 / SmolVLM processors offline and without torchvision: the tiny one, and loading a checkpoint's.

The tiny processor is the real ``Idefics3Processor`` with the PIL ``Idefics3ImageProcessorPil`` and a small
tokenizer built here (SmolVLM's tokenizer cannot be downloaded): the smallest correct processor. Its vocabulary
is a fixed list, made into a ``tokenizers`` word-level model when the processor is built (nothing is trained),
with SmolVLM's special tokens (``<fake_token_around_image>``, ``<image>``, ``<end_of_utterance>``,
``<global-img>`` and the 36 ``<row_i_col_j>`` tile tokens) as added tokens. Like SmolVLM's GPT-2 style tokenizer it
adds no special tokens of its own and keeps a run of newlines as one token, so the ``\\n`` after each row of tiles
and the ``\\n\\n`` before the global view tokenize as they do for SmolVLM. Spaces are not kept (one word, one token).

Images are resized to a 64 px longest edge, then to multiples of 32 px, and cut into 32x32 tiles followed by a
32x32 global view: a square image is 2x2 tiles + 1, a 64x32 one 1x2 + 1. A tile is 4x4 patches of 8x8 pixels,
pixel-shuffled by 2 into 4 ``<image>`` tokens.

Real checkpoints: Idefics3 / SmolVLM (v1) directories name ``Idefics3Processor``, which ``AutoProcessor`` builds
here with the PIL image processor. SmolVLM2 directories name ``SmolVLMProcessor``, which insists on a video
processor (torchvision) and on the ``num2words`` package; `load_processor` builds it without the video processor
(vlmreg feeds images only), and transformers' own error asks for num2words where it is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmreg.sdk.processor_files import processor_class_of

TILE_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *TILE_TOKENS,
)
NEWLINE_RUNS = tuple("\n" * n for n in range(1, 9))
# Chat roles; the words of the bundled tasks (colour, colour_turns, count) and of the conformance prompts.
WORDS = tuple(
    [
        "User",
        "Assistant",
        "System",
        "user",
        "assistant",
        "system",
        "What",
        "what",
        "colour",
        "color",
        "is",
        "the",
        "shape",
        "shapes",
        "image",
        "?",
        "Red",
        "Green",
        "Blue",
        "red",
        "green",
        "blue",
        ",",
        ".",
        "!",
        ":",
        "'",
        "or",
        "and",
        "And",
        "this",
        "one",
        "How",
        "how",
        "many",
        "are",
        "there",
        "Put",
        "number",
        "in",
        "\\",
        "boxed",
        "{",
        "}",
        "a",
        "of",
        "which",
        "yes",
        "no",
        "answer",
        "circle",
        "square",
        "triangle",
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
        "6",
        "7",
        "8",
        "9",
    ]
)
VOCAB = (*SPECIAL, *NEWLINE_RUNS, *WORDS)
VOCAB_SIZE = len(VOCAB)  # the embedding size too: a random model cannot sample an id the tokenizer lacks
IMAGE_ID = VOCAB.index("<image>")
PAD_ID, BOS_ID, EOS_ID = VOCAB.index("<|im_end|>"), VOCAB.index("<|im_start|>"), VOCAB.index("<end_of_utterance>")

TILE_SIZE = 32
LONGEST_EDGE = 64
PATCH_SIZE = 8
SCALE_FACTOR = 2
TOKENS_PER_TILE = (TILE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 4

# SmolVLM-Instruct's chat template, plus one case: a message whose content is a plain string (the published
# template iterates over a string's characters and renders none of them).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tiny_tokenizer() -> Any:
    # deferred: start-up cost (loads tokenizers)
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {token: i for i, token in enumerate(VOCAB)}
    if len(vocab) != VOCAB_SIZE:
        raise AssertionError("the tiny Idefics3 vocabulary lists a token twice")
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    backend.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )


def tiny_processor() -> Any:
    """An ``Idefics3Processor``: image splitting into 32 px tiles plus a global view, 4 ``<image>`` tokens a tile."""
    # deferred: start-up cost (loads transformers)
    from transformers import Idefics3Processor  # noqa: PLC0415
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil  # noqa: PLC0415

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": TILE_SIZE},
        do_image_splitting=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        image_seq_len=TOKENS_PER_TILE,
        chat_template=CHAT_TEMPLATE,
    )


def _smolvlm_without_video() -> type[Any]:
    # deferred: start-up cost (loads transformers)
    from transformers import ProcessorMixin  # noqa: PLC0415
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor  # noqa: PLC0415

    class SmolVLMImageProcessor(SmolVLMProcessor):
        """``SmolVLMProcessor`` with its image processor and tokenizer and no video processor (processors read their
        parts from the ``__init__`` signature)."""

        def __init__(
            self,
            image_processor: Any = None,
            tokenizer: Any = None,
            image_seq_len: int = 169,
            chat_template: str | None = None,
            **kwargs: Any,
        ):
            super().__init__(
                image_processor, tokenizer, None, image_seq_len=image_seq_len, chat_template=chat_template, **kwargs
            )

        def apply_chat_template(self, conversation: Any, chat_template: str | None = None, **kwargs: Any) -> Any:
            # SmolVLMProcessor's own version only adds the video processor's frame defaults; there is none here.
            return ProcessorMixin.apply_chat_template(self, conversation, chat_template=chat_template, **kwargs)

    return SmolVLMImageProcessor


def load_processor(directory: str | Path) -> Any:
    """A checkpoint's processor without torchvision: ``AutoProcessor`` for Idefics3 / SmolVLM directories, an
    image-only ``SmolVLMProcessor`` for SmolVLM2 ones."""
    if processor_class_of(directory) == "SmolVLMProcessor":
        return _smolvlm_without_video().from_pretrained(str(directory), local_files_only=True)
    # deferred: start-up cost (loads transformers)
    from transformers import AutoProcessor  # noqa: PLC0415

    return AutoProcessor.from_pretrained(str(directory), local_files_only=True)

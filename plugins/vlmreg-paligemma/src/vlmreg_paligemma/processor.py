"""The tiny offline PaliGemma processor: transformers' own ``PaliGemmaProcessor`` and PIL SigLIP image processor, with
a small tokenizer.

Gemma's tokenizer (257k pieces) cannot be downloaded here; ``PaliGemmaProcessor`` needs nothing else that is missing
(no video processor, so no torchvision). The smallest correct processor is the real one with a vocabulary cut down to
the words the bundled tasks and the conformance checks use, made into a ``tokenizers`` word-level model when the
processor is built (nothing is trained). It keeps what the real tokenizer does where vlmreg can see it:

- ids 0-3 are ``<pad> <eos> <bos> <unk>``, Gemma's order, and ``<image>`` is an added special token, as in the
  published tokenizers; the processor itself adds the 1,024 ``<locNNNN>`` and 128 ``<segNNN>`` tokens, as it does to
  the real one (so the model's vocabulary is ``VOCAB_SIZE``, those included);
- a run of newlines is one token, so the ``"\\n"`` the processor writes after the prompt is a token of its own.

The processor writes the prompt as PaliGemma was trained on it: every image's ``<image>`` x ``image_seq_length``
first, then ``<bos>``, the prompt and ``"\\n"``; the answer (``suffix``) follows and ends with ``<eos>``, the
turn end. The chat template renders a user turn's images as ``<image>`` and its text as is, and an assistant turn's
text closed by ``<eos>``: PaliGemma checkpoints publish no chat template, and this one writes exactly the
processor's prefix / suffix layout. Images are resized to 32x32 and cut into 8x8 patches: 16 image tokens.
"""

from __future__ import annotations

from typing import Any

SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<image>")
NEWLINE_RUNS = tuple("\n" * n for n in range(1, 9))
# The words of the bundled tasks (colour, count) and of the conformance prompts; PaliGemma's task prefixes.
WORDS = (
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
    "en",
    "caption",
    "describe",
    "detect",
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
)
BASE_VOCAB = (*SPECIAL, *NEWLINE_RUNS, *WORDS)
#: ``<locNNNN>`` x 1024 and ``<segNNN>`` x 128, which ``PaliGemmaProcessor`` adds to any tokenizer it is given
PROCESSOR_ADDED = 1024 + 128
VOCAB_SIZE = len(BASE_VOCAB) + PROCESSOR_ADDED  # the embedding size: every id the processor's tokenizer has
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
IMAGE_ID = BASE_VOCAB.index("<image>")

IMAGE_SIZE = 32
PATCH_SIZE = 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2

CHAT_TEMPLATE = """
{%- for message in messages -%}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {{ '<eos>' }}
    {%- endif -%}
{%- endfor -%}
"""


def tiny_tokenizer() -> Any:
    # deferred: start-up cost (loads tokenizers)
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {token: i for i, token in enumerate(BASE_VOCAB)}
    if len(vocab) != len(BASE_VOCAB):
        raise AssertionError("the tiny PaliGemma vocabulary lists a token twice")
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
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
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )


def tiny_processor() -> Any:
    """A ``PaliGemmaProcessor``: the PIL SigLIP image processor at 32x32 (16 image tokens), the tiny tokenizer."""
    # deferred: start-up cost (loads transformers)
    from transformers import PaliGemmaProcessor  # noqa: PLC0415
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil  # noqa: PLC0415

    image_processor = SiglipImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    image_processor.image_seq_length = TOKENS_PER_IMAGE  # as the published preprocessor_config.json carries it
    processor = PaliGemmaProcessor(
        image_processor=image_processor, tokenizer=tiny_tokenizer(), chat_template=CHAT_TEMPLATE
    )
    if len(processor.tokenizer) != VOCAB_SIZE:
        raise AssertionError(f"the tiny PaliGemma tokenizer has {len(processor.tokenizer)} ids, not {VOCAB_SIZE}")
    return processor

"""The tiny offline Gemma 3 processor: transformers' own ``Gemma3Processor`` and PIL image processor, a small tokenizer.

Gemma's tokenizer (262k pieces) cannot be downloaded here, and ``Gemma3Processor`` needs nothing else that is
missing (it has no video processor, so no torchvision): the smallest correct processor is the real one with a
vocabulary cut down to the words the bundled tasks and the conformance checks use. The vocabulary is a fixed
list, made into a ``tokenizers`` word-level model when the processor is built (nothing is trained), and it keeps
what the real tokenizer does where vlmreg can see it:

- a run of newlines is one token (Gemma's vocabulary has ``"\\n"``, ``"\\n\\n"``, ...), so the blank lines the
  processor writes around each image merge with the template's newlines the way they do with the real tokenizer;
- ``<bos>`` is prepended when special tokens are added (the real ``add_bos_token``), and ids 0-3 are
  ``<pad> <eos> <bos> <unk>``, Gemma's order;
- the special tokens are added tokens, split out first.

Words are split at whitespace and punctuation, and spaces are not kept, so decoding puts a space between tokens.
The chat template is Gemma 3 IT's; an image renders as ``<start_of_image>`` (the processor's ``boi_token``),
which the processor expands to ``\\n\\n<start_of_image>``, ``<image_soft_token>`` x ``image_seq_length``,
``<end_of_image>\\n\\n``. Images are resized to 32x32 and cut into 8x8 patches, pooled to 2x2 = 4 soft tokens.
"""

from __future__ import annotations

from typing import Any

SPECIAL = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
NEWLINE_RUNS = tuple("\n" * n for n in range(1, 9))
# Chat roles; the words of the bundled tasks (colour, colour_turns, count) and of the conformance prompts.
WORDS = tuple(
    [
        "user",
        "model",
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
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BOI_ID = VOCAB.index("<start_of_image>")
EOI_ID = VOCAB.index("<end_of_image>")
IMAGE_ID = VOCAB.index("<image_soft_token>")

IMAGE_SIZE = 32
PATCH_SIZE = 8
TOKENS_PER_IMAGE = 4  # (32 / 8)^2 = 16 patches, average-pooled 2x2 -> 4

# Gemma 3 IT's chat template (google/gemma-3-4b-it), as a Jinja string.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def tiny_tokenizer() -> Any:
    # deferred: start-up cost (loads tokenizers)
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {token: i for i, token in enumerate(VOCAB)}
    if len(vocab) != VOCAB_SIZE:
        raise AssertionError("the tiny Gemma 3 vocabulary lists a token twice")
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    backend.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )


def tiny_processor() -> Any:
    """A ``Gemma3Processor``: the PIL image processor at 32x32, 4 soft tokens an image, the tiny tokenizer."""
    # deferred: start-up cost (loads transformers)
    from transformers import Gemma3Processor  # noqa: PLC0415
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # noqa: PLC0415

    image_processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )

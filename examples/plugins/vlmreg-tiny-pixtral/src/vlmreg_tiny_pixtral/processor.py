"""A tiny offline Mistral 3 processor: the real `PixtralProcessor` and PIL image processor, a word-level tokenizer.

Nothing is trained or downloaded: the vocabulary is a fixed word list, built into a ``tokenizers`` word-level
model at call time. Its first 20 ids are Mistral's (Tekken's) control tokens in their real order, so ``[IMG]``
is 10, ``[IMG_BREAK]`` 12 and ``[IMG_END]`` 13, as in the real checkpoints and `Mistral3Config`'s default. Like
the real tokenizer it prepends ``<s>`` when special tokens are asked for and keeps runs of newlines as single
tokens. Spaces are dropped (each word is one token).

Images keep their native size (only images larger than 64 px are scaled down) and are cut into 16x16 cells
(8 px patches, merged 2x2): a 64x64 image is 4 rows of 4 ``[IMG]``, each row ended by ``[IMG_BREAK]``, the
last by ``[IMG_END]`` (20 tokens); a 32x48 (width x height) one is 3 rows of 2 (9 tokens).

``PixtralProcessor``'s module imports a helper from the torchvision image processor at import time, though
only ``_get_num_multimodal_tokens`` (not used here) calls it. Without torchvision, `processor_class` imports the
module against a stand-in that supplies the PIL image processor's identical helper, then removes the
stand-in again; with torchvision the module is imported as it is.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

# Tekken's control tokens, ids 0-19 in their real order.
SPECIAL = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]
NEWLINES = ["\n" * k for k in range(1, 9)]
# The bundled tasks' prompts and answers (colour, colour_turns, count) and the conformance suite's prompts.
WORDS = [
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
]
WORDS += [
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
]
WORDS += ["circle", "square", "triangle"] + [str(i) for i in range(10)]
VOCAB = SPECIAL + NEWLINES + WORDS
VOCAB_SIZE = len(VOCAB)  # exactly: a random model can sample no id the tokenizer lacks
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 11
IMAGE_TOKEN_ID = VOCAB.index("[IMG]")

LONGEST_EDGE = 64  # larger images are scaled down to this longest edge; smaller ones keep their size
PATCH_SIZE = 8
SPATIAL_MERGE_SIZE = 2  # each [IMG] token is 2x2 patches: a 16x16 pixel cell

# Mistral Small 3.1's chat template, without its default system prompt (a system prompt is rendered only when
# the conversation has one); assistant content may be a string or a list of text parts.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if message['content'] is string %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' }}"
    "{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}"
    "{%- else %}{{- raise_exception('Only text and image blocks are supported in message content!') }}{%- endif %}"
    "{%- endfor %}{{- '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'system' %}"
    "{%- if message['content'] is string %}{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- message['content'][0]['text'] + eos_token }}{%- endif %}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}{%- endif %}"
    "{%- endfor %}"
)

_TORCHVISION_HELPER = "transformers.models.pixtral.image_processing_pixtral"


def processor_class() -> Any:
    """The real ``PixtralProcessor``, importable without torchvision (see the module docstring)."""
    try:
        module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("torchvision"):
            raise
        # deferred: optional, its absence is handled here
        from transformers.models.pixtral import image_processing_pil_pixtral  # noqa: PLC0415

        stand_in: Any = types.ModuleType(_TORCHVISION_HELPER)  # a module with one function, set below
        stand_in.get_resize_output_image_size = image_processing_pil_pixtral.get_resize_output_image_size
        sys.modules[_TORCHVISION_HELPER] = stand_in
        try:
            module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
        finally:
            del sys.modules[_TORCHVISION_HELPER]
    return module.PixtralProcessor


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer: newline runs kept as tokens, other whitespace dropped, ``<s>`` prepended."""
    vocab = {token: i for i, token in enumerate(VOCAB)}
    assert len(vocab) == VOCAB_SIZE, "a token is listed twice"
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    backend.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "[IMG]"},
    )


def tiny_processor() -> Any:
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE},
        patch_size={"height": PATCH_SIZE, "width": PATCH_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return processor_class()(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        patch_size=PATCH_SIZE,
        spatial_merge_size=SPATIAL_MERGE_SIZE,
        chat_template=CHAT_TEMPLATE,
    )

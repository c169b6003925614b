"""The tiny GLM-4.1V vocabulary and chat template: fixed lists, so the tiny config and the shipped tokenizer agree.

Token ids are positions in `VOCAB`. GLM-4.1V's control tokens come first, in GLM's order (``<|endoftext|>`` first,
then the mask and role tokens, then the image and video markers); the reasoning markers follow; then runs of
newlines and the words of the bundled tasks (colour, colour_turns, count) and of the conformance prompts.
No import of torch or transformers here.
"""

from __future__ import annotations

#: Special (control) tokens: split out before words, and dropped when decoding with ``skip_special_tokens``.
SPECIAL = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
#: Added tokens that decoding keeps: GLM-4.1V-Thinking writes ``<think>...</think><answer>...</answer>``.
MARKERS = ("<think>", "</think>", "<answer>", "</answer>", "<|begin_of_box|>", "<|end_of_box|>")
NEWLINE_RUNS = tuple("\n" * n for n in range(1, 9))
WORDS = tuple(
    [
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
VOCAB = (*SPECIAL, *MARKERS, *NEWLINE_RUNS, *WORDS)
VOCAB_SIZE = len(VOCAB)  # the embedding size too: a random model cannot sample an id the tokenizer lacks

PAD_ID = EOS_ID = VOCAB.index("<|endoftext|>")
IMAGE_ID, VIDEO_ID = VOCAB.index("<|image|>"), VOCAB.index("<|video|>")
IMAGE_START_ID, IMAGE_END_ID = VOCAB.index("<|begin_of_image|>"), VOCAB.index("<|end_of_image|>")
VIDEO_START_ID, VIDEO_END_ID = VOCAB.index("<|begin_of_video|>"), VOCAB.index("<|end_of_video|>")
#: The ids GLM-4.1V's generation config stops at, by name: end of text, and the role tokens that open the next turn.
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

#: Patch 14, merge 2 as GLM-4.1V; images between 28x28 and 112x112 pixels (a 64x64 image: 56x56, 4 tokens).
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112

# Renders what GLM-4.1V-9B-Thinking's template renders (the same text for system, user, image, text and assistant
# parts, and the generation prompt), written for this asset. Extensions where the published template renders
# nothing useful: a system or assistant message given as content parts has its text parts joined.
CHAT_TEMPLATE = """\
{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
[gMASK]<sop>
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{{ '<|system|>\\n' }}{{ text_of(message['content']) }}
{%- elif message['role'] == 'user' -%}
{{ '<|user|>\\n' }}
{%- if message['content'] is string -%}{{ message['content'] }}
{%- else -%}{%- for part in message['content'] -%}
{%- if part['type'] == 'video' or 'video' in part -%}{{ '<|begin_of_video|><|video|><|end_of_video|>' }}
{%- elif part['type'] == 'image' or 'image' in part -%}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- elif message['role'] == 'assistant' -%}
{{ '<|assistant|>' }}{{ message['metadata'] if message['metadata'] else '' }}{{ '\\n' }}{{ text_of(message['content']) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}
"""  # noqa: E501 - the template's lines as GLM-4.1V's has them

"""A tiny offline Idefics3 (SmolVLM) processor: the real `Idefics3Processor` and PIL image processor, a word-level
tokenizer.

Nothing is trained or downloaded: the vocabulary is a fixed word list, built into a ``tokenizers`` word-level
model at call time, with SmolVLM's special tokens (``<fake_token_around_image>``, ``<image>``,
``<end_of_utterance>``, ``<global-img>`` and the 36 ``<row_i_col_j>`` tile tokens) as added tokens. Like the real
(GPT-2 style) tokenizer it adds no special tokens of its own and keeps runs of newlines as single tokens, so the
``\\n`` after each row of tiles and the ``\\n\\n`` before the global image tokenize as they do for SmolVLM.
Spaces are dropped (each word is one token).

Images: each is resized so its longest edge is 64 px, then to multiples of 32 px, and cut into 32x32 tiles;
a 32x32 global view follows. A square image gives 2x2 tiles + the global one, a 64x32 one 1x2 + 1. Each tile
is 4 ``<image>`` tokens (8x8 patches of a 32x32 tile, 4x4 = 16 patches, pixel-shuffled by 2 to 4).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import Idefics3Processor, PreTrainedTokenizerFast
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

TILES = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *TILES,
]
NEWLINES = ["\n" * k for k in range(1, 9)]
# Roles, the bundled tasks' prompts and answers (colour, colour_turns, count) and the conformance suite's prompts.
WORDS = [
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
]
WORDS += [
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
]
WORDS += ["\\", "boxed", "{", "}", "a", "of", "which", "yes", "no", "answer", "circle", "square", "triangle"] + [
    str(i) for i in range(10)
]
VOCAB = SPECIAL + NEWLINES + WORDS
VOCAB_SIZE = len(VOCAB)  # exactly: a random model can sample no id the tokenizer lacks
IMAGE_TOKEN_ID = VOCAB.index("<image>")
PAD_ID, BOS_ID, EOS_ID = VOCAB.index("<|im_end|>"), VOCAB.index("<|im_start|>"), VOCAB.index("<end_of_utterance>")

TILE_SIZE = 32  # the vision encoder's input: max_image_size and the tiles' side
LONGEST_EDGE = 64  # images are resized to this longest edge before tiling
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 4 <image> tokens per tile

# SmolVLM-Instruct's chat template, with one addition: a message whose content is a string (the real template
# iterates over its characters and renders nothing).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer: newline runs kept as tokens, other whitespace dropped, nothing added."""
    vocab = {token: i for i, token in enumerate(VOCAB)}
    assert len(vocab) == VOCAB_SIZE, "a token is listed twice"
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    backend.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )


def tiny_processor() -> Idefics3Processor:
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
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )

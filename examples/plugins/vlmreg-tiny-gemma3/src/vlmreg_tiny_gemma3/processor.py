"""A tiny offline Gemma 3 processor: the real `Gemma3Processor` and PIL image processor, a word-level tokenizer.

Nothing is trained or downloaded: the vocabulary is a fixed word list, built into a ``tokenizers`` word-level
model at call time. It keeps what the real Gemma tokenizer does where vlmreg's data path can see it:

- runs of newlines are single tokens (``"\\n"``, ``"\\n\\n"``, ``"\\n\\n\\n"``, ...), as in Gemma's vocabulary, so
  the blank lines the processor puts around each image merge with the template's newlines exactly as they do
  with the real tokenizer;
- ``<bos>`` is added when special tokens are asked for (the real tokenizer's ``add_bos_token``);
- every special token is an added token, split out before anything else.

Spaces are dropped (each word is one token), so decoded text has a space between all tokens.
The chat template is Gemma 3 IT's own: an image renders as ``<start_of_image>`` (the processor's ``boi_token``),
which the processor expands to ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x ``image_seq_length`` +
``<end_of_image>\\n\\n``; turns end with ``<end_of_turn>``.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import Gemma3Processor, PreTrainedTokenizerFast
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

# The real Gemma order for the first four ids (pad 0, eos 1, bos 2, unk 3).
SPECIAL = [
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
]
NEWLINES = ["\n" * k for k in range(1, 9)]
# Roles, the bundled tasks' prompts and answers (colour, colour_turns, count) and the conformance suite's prompts.
WORDS = [
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
]
WORDS += [
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
]
WORDS += ["answer", "circle", "square", "triangle"] + [str(i) for i in range(10)]
VOCAB = SPECIAL + NEWLINES + WORDS
VOCAB_SIZE = len(VOCAB)  # exactly: a random model can sample no id the tokenizer lacks
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BOI_TOKEN_ID = VOCAB.index("<start_of_image>")
EOI_TOKEN_ID = VOCAB.index("<end_of_image>")
IMAGE_TOKEN_ID = VOCAB.index("<image_soft_token>")

IMAGE_SIZE = 32  # the SigLIP tower's input: every image is resized to 32x32
PATCH_SIZE = 8  # 4x4 patches ...
MM_TOKENS_PER_IMAGE = 4  # ... average-pooled to 2x2: four <image_soft_token> per image

# Gemma 3 IT's chat template, verbatim.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer: newline runs kept as tokens, other whitespace dropped, ``<bos>`` prepended."""
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
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    backend.add_special_tokens(SPECIAL)
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


def tiny_processor() -> Gemma3Processor:
    image_processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=MM_TOKENS_PER_IMAGE,
    )

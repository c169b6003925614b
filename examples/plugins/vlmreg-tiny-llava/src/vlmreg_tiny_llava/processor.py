"""A tiny offline LLaVA processor: a fixed word-level vocabulary (nothing trained, nothing downloaded)."""

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlavaProcessor, PreTrainedTokenizerFast
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

SPECIAL = ["<pad>", "<s>", "</s>", "<image>", "<unk>"]
WORDS = [
    "system",
    "user",
    "assistant",
    ":",
    "?",
    ".",
    ",",
    "!",
    "what",
    "which",
    "how",
    "many",
    "colour",
    "color",
    "shape",
    "is",
    "the",
    "a",
    "of",
    "in",
    "image",
    "answer",
]
WORDS += [
    "red",
    "green",
    "blue",
    "yellow",
    "orange",
    "purple",
    "black",
    "white",
    "circle",
    "square",
    "triangle",
    "yes",
    "no",
]
WORDS += [str(i) for i in range(10)]
WORDS += ["What", "Red", "Green", "Blue", "or"]  # the bundled colour task's words, as it writes them
IMAGE_TOKEN_ID = SPECIAL.index("<image>")
VOCAB_SIZE = 64  # room to spare: the embedding table must cover the vocabulary
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : "
    "{% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for p in m['content'] %}{% if p['type'] in ('image', 'image_url') %}<image> {% else %}{{ p['text'] "
    "}} {% endif %}{% endfor %}{% endif %}</s> {% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)


def tiny_processor() -> LlavaProcessor:
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    assert len(vocab) <= VOCAB_SIZE
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # 32x32 pixels in 8x8 patches: 16 patch features (the CLS feature is dropped by the "default" strategy).
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
    )

"""Build the tiny GLM-4.1V processor asset shipped in ``vlmreg_glm4v/tiny_processor``.

Run once by a maintainer (never at import time): ``python scripts/build_tiny_processor.py``. Nothing is trained:
the vocabulary is the fixed list in `vlmreg_glm4v.vocab`, made into a ``tokenizers`` word-level model, wrapped in
``PreTrainedTokenizerFast`` and saved with the chat template and the PIL image processor's settings.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from vlmreg_glm4v import vocab as v
from vlmreg_glm4v.processor import ImageOnlyGlm4vProcessor


def build(out: Path) -> None:
    ids = {token: i for i, token in enumerate(v.VOCAB)}
    if len(ids) != v.VOCAB_SIZE:
        raise AssertionError("the tiny GLM-4.1V vocabulary lists a token twice")
    backend = Tokenizer(models.WordLevel(vocab=ids, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in v.SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in v.MARKERS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=4096,
    )
    image_processor = Glm4vImageProcessorPil(
        patch_size=v.PATCH_SIZE,
        merge_size=v.MERGE_SIZE,
        temporal_patch_size=v.TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": v.MIN_PIXELS, "longest_edge": v.MAX_PIXELS},
    )
    processor = ImageOnlyGlm4vProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=v.CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    for token, i in ids.items():
        assert tokenizer.convert_tokens_to_ids(token) == i, token
    print(f"wrote {out}: vocab {len(tokenizer)}")


if __name__ == "__main__":
    build(Path(__file__).resolve().parents[1] / "src" / "vlmreg_glm4v" / "tiny_processor")

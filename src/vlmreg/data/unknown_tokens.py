"""How much of a run's text the family's tokenizer cannot read: the share of it that becomes the unknown token.

A word the vocabulary lacks is one ``<unk>`` id to the model, whatever the word was: a prompt full of them asks
nothing, and an answer made of them can never be written, so the run trains to reward 0 without an error anywhere.
`survey_unknown_tokens` tokenizes the text the data brings (every message's text, the system prompt included, and
each answer that is a string) as the tokenizer alone does (no chat template, no special tokens added), for the
first `SURVEY_EXAMPLES` examples, and names the words that became the unknown token. ``vlmreg train`` warns when
more than `WARN_SHARE` of those tokens are unknown; ``vlmreg data preview`` shows the same report.

A tokenizer without an unknown token (byte-level BPE) maps every text to known tokens: nothing to report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

__all__ = [
    "SURVEY_EXAMPLES",
    "WARN_SHARE",
    "UnknownTokens",
    "survey_unknown_tokens",
    "unknown_token_id",
    "warn_unknown_tokens",
]

#: Examples read by the survey, from the first: enough to see a vocabulary mismatch, few enough to take milliseconds.
SURVEY_EXAMPLES = 1000
#: ``vlmreg train`` warns above this share of unknown tokens in the data's text (1%).
WARN_SHARE = 0.01
_WORDS_NAMED = 8


def unknown_token_id(tokenizer: Any) -> int | None:
    """The tokenizer's unknown-token id, or None when it has none (or its unknown token doubles as eos, bos or pad,
    as GPT-2's ``<|endoftext|>`` does: plain text never becomes it, and counting it would count the markup)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(unk, int):
        return None
    others = {getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "bos", "pad")}
    return None if unk in others else unk


@attrs.frozen
class UnknownTokens:
    """What the survey found: tokens counted, how many were the unknown token, which words became it (most
    frequent first, with their counts), and the distinct answers holding one (which the model can never write)."""

    unknown_token: str
    examples: int
    tokens: int
    unknown: int
    words: tuple[tuple[str, int], ...]
    answers: tuple[str, ...]

    @property
    def share(self) -> float:
        return self.unknown / self.tokens if self.tokens else 0.0

    @property
    def too_many(self) -> bool:
        return self.share > WARN_SHARE

    def describe(self, family: str) -> str:
        """One line: the count and share, the words named, the answers the model cannot write, and what to do."""
        words = ", ".join(f"{word!r} ({count})" for word, count in self.words[:_WORDS_NAMED])
        more = f" and {len(self.words) - _WORDS_NAMED} more" if len(self.words) > _WORDS_NAMED else ""
        named = f": {words}{more}" if words else ""
        answers = ""
        if self.answers:
            shown = ", ".join(repr(a) for a in self.answers[:_WORDS_NAMED])
            extra = f" and {len(self.answers) - _WORDS_NAMED} more" if len(self.answers) > _WORDS_NAMED else ""
            answers = f"; the model can never write the answers {shown}{extra}"
        return (
            f"{self.unknown:,} of {self.tokens:,} text tokens ({self.share:.1%}) in the first {self.examples:,} "
            f"examples are the unknown token {self.unknown_token!r} of family {family}'s tokenizer{named}{answers}. "
            "The model cannot tell these words apart; use a tokenizer whose vocabulary covers the data "
            "(`vlmreg data preview CONFIG` shows what the model sees)"
        )


def _texts(messages: Iterable[Any]) -> Iterable[str]:
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            yield content
            continue
        for part in content:
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                yield part["text"]


def survey_unknown_tokens(
    tokenizer: Any, examples: Sequence[Any], *, limit: int = SURVEY_EXAMPLES
) -> UnknownTokens | None:
    """Tokenize the text of the first ``limit`` examples and count the unknown token (None: the tokenizer has none)."""
    unk = unknown_token_id(tokenizer)
    if unk is None:
        return None
    texts: Counter[str] = Counter()
    answers: set[str] = set()
    chosen = examples[:limit]
    for example in chosen:
        texts.update(text for text in _texts(example.messages) if text)
        if isinstance(example.answer, str) and example.answer:
            texts[example.answer] += 1
            answers.add(example.answer)
    unique = list(texts)
    tokens = unknown = 0
    words: Counter[str] = Counter()
    bad_answers: list[str] = []
    fast = bool(getattr(tokenizer, "is_fast", False))
    for start in range(0, len(unique), 256):
        batch = unique[start : start + 256]
        encoded = tokenizer(batch, add_special_tokens=False, return_offsets_mapping=fast)
        for index, (text, ids) in enumerate(zip(batch, encoded["input_ids"], strict=True)):
            weight = texts[text]
            at = [i for i, token in enumerate(ids) if token == unk]
            tokens += weight * len(ids)
            unknown += weight * len(at)
            if not at:
                continue
            if text in answers:
                bad_answers.append(text)
            if fast:
                offsets = encoded["offset_mapping"][index]
                for i in at:
                    words[text[offsets[i][0] : offsets[i][1]] or "?"] += weight
    token = str(getattr(tokenizer, "unk_token", None) or tokenizer.convert_ids_to_tokens(unk))
    return UnknownTokens(
        unknown_token=token,
        examples=len(chosen),
        tokens=tokens,
        unknown=unknown,
        words=tuple(words.most_common()),
        answers=tuple(sorted(bad_answers)),
    )


def warn_unknown_tokens(processor: Any, examples: Sequence[Any], family: str, log: Any) -> UnknownTokens | None:
    """``log`` a warning when more than `WARN_SHARE` of the examples' text is the unknown token; the survey either
    way."""
    found = survey_unknown_tokens(getattr(processor, "tokenizer", processor), examples)
    if found is not None and found.too_many:
        log(f"warning: {found.describe(family)}")
    return found

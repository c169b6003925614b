"""What a failed parity check asks of the family: the requirement of the processor contract (docs/reference.md, "The
processor contract", numbered there) and the descriptor fields that lift it or say how the family differs.

``vlmreg check`` prints the hint under each failed check; the conformance suite adds it to its failures.
"""

from __future__ import annotations

__all__ = ["CONTRACT_HINTS", "contract_hint"]

#: check-name prefix -> the requirement and the fields; the first prefix that starts the name wins.
CONTRACT_HINTS = (
    (
        "prompt",
        (
            "processor contract requirements 2, 5-7 (an image renders as one placeholder, expands the same wherever it "
            "stands, its tensors collate as the processor's): fields image_placeholder, collate_images, "
            "processor_layout; prefix_lm for a processor that writes a prompt only as a whole"
        ),
    ),
    (
        "logprobs",
        (
            "processor contract requirement 9 (the model's attention and positions follow inputs vlmreg reproduces): "
            "fields position_ids, packing (packed rows), prefix_lm (a prompt attended bidirectionally through an "
            "input the processor gives), prepare_model"
        ),
    ),
    (
        "stops at the turn end",
        "processor contract requirement 3 (an assistant turn closes with one token): field turn_end_tokens",
    ),
    (
        "sampler logprobs",
        (
            "processor contract requirement 9, while sampling (an input the processor gives that changes attention or "
            "positions): fields prefix_lm (a prompt attended bidirectionally through an input the processor gives), "
            "position_ids"
        ),
    ),
    (
        "3-turn",
        (
            "processor contract requirement 8 (a conversation continues after a sampled turn): fields turn_end_tokens; "
            "prefix_lm for a processor that writes the whole conversation as one prefix (the family is then "
            "single-turn)"
        ),
    ),
    (
        "video",
        (
            "processor contract requirements 2, 5-7 for videos: fields video_placeholder, max_videos_per_message, "
            "collate_images"
        ),
    ),
)


def contract_hint(check: str) -> str:
    """The requirement and fields for a failed check named ``check`` (``""`` when none applies)."""
    return next((hint for prefix, hint in CONTRACT_HINTS if check.startswith(prefix)), "")

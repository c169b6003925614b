"""GLM-4.1V's 3-D rope positions for training, from the model's own ``get_rope_index``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def rope_position_ids(model: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """(4, B, L) positions for one sequence or a padded batch: row 0 the plain text positions transformers builds the
    causal mask from (so a packed row's segments stay apart), rows 1-3 the (temporal, height, width) positions
    ``Glm4vModel.get_rope_index`` gives: text advances by one a token, an image's tokens take their grid coordinates
    and the text after it resumes at the image's start plus its larger side in merged patches."""
    ids = inputs["input_ids"]
    rope, _ = model.base_model.get_rope_index(
        ids,
        mm_token_type_ids=inputs.get("mm_token_type_ids", torch.zeros_like(ids)),
        image_grid_thw=inputs.get("image_grid_thw"),
        attention_mask=inputs["attention_mask"],
    )
    text = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return torch.cat([text[None].to(rope.device), rope], dim=0)

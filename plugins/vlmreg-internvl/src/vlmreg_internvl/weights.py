"""In-memory parameter names of ``InternVLForConditionalGeneration`` and the names its published checkpoints use.

transformers 5 nests the decoder under ``model.language_model`` and the vision tower and projector under
``model.``. The published ``-hf`` checkpoints (OpenGVLab/InternVL3-{1,2,8,14,38,78}B-hf, and the InternVL3.5
``-HF`` ones) were written by transformers 4.5x's ``save_pretrained``, which wrote the layout of the first LLaVA
release: ``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*`` (embeddings,
``encoder.layer.{i}.attention.{q,k,v}_proj``, ``lambda_1``, ...) and ``multi_modal_projector.*``
(``layer_norm``, ``linear_1``, ``linear_2``). transformers 5 loads that through its ``llava`` conversion
mapping (``internvl`` uses it), vLLM maps it too, and transformers 5.23's own ``save_pretrained`` still writes
it; so it is what goes on the wire. Shapes do not change.
"""

from __future__ import annotations

from vlmreg import PrefixRenames

#: (in-memory prefix, checkpoint prefix).
PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)

#: The descriptor's ``checkpoint_weights`` / ``memory_weights``; a name under none of the prefixes is an error.
RENAMES = PrefixRenames(PREFIXES, label="an InternVL")
checkpoint_weights = RENAMES.checkpoint_weights
memory_weights = RENAMES.memory_weights

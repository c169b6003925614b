"""In-memory parameter names of ``PaliGemmaForConditionalGeneration`` and the names its published checkpoints use.

transformers 5 nests the decoder under ``model.language_model`` and holds the SigLIP tower without its
``vision_model`` wrapper. The published checkpoints (google/paligemma-* and google/paligemma2-*) keep the layout of
the first release: ``language_model.model.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*`` (and
``language_model.lm_head.*``, absent there because the head is tied). That is what other engines load, so it is
what goes on the wire. ``save_pretrained`` (transformers 5.24, measured) writes ``vision_tower.*`` without the
wrapper; transformers loads both (its SigLIP loader drops a ``vision_model.`` prefix).
"""

from __future__ import annotations

from vlmreg import PrefixRenames

#: (in-memory prefix, checkpoint prefix)
PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)

#: The descriptor's ``checkpoint_weights`` / ``memory_weights``; a name under none of the prefixes is an error.
RENAMES = PrefixRenames(PREFIXES, label="a PaliGemma")
checkpoint_weights = RENAMES.checkpoint_weights
memory_weights = RENAMES.memory_weights

"""In-memory parameter names of ``LlavaOnevisionForConditionalGeneration`` and the names its published checkpoints use.

transformers 5 nests the parts under ``model.``: ``model.language_model.*`` (the Qwen2 decoder without its head),
``model.vision_tower.*`` (SigLIP, held without its ``vision_model`` wrapper, which transformers drops on load),
``model.multi_modal_projector.{linear_1,linear_2}``, ``model.image_newline`` and, at the top, ``lm_head``. The llava-hf
checkpoints
(``llava-hf/llava-onevision-qwen2-{0.5b,7b,72b}-{ov,si}-hf``, ``-7b-ov-chat-hf``, ``-72b-ov-chat-hf``) were written in
the first LLaVA layout: ``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.vision_model.*``,
``multi_modal_projector.*`` and a bare ``image_newline``. transformers 5 reads that through the ``llava_next``
conversion mapping (``llava_onevision`` uses it: the same five prefixes, ``image_newline`` included) plus its SigLIP
rule that drops a ``vision_model.`` segment. vLLM's ``LlavaOnevisionForConditionalGeneration`` loads exactly these
names (its ``hf_to_vllm_mapper`` maps transformers-5 names onto them, and its tower is a ``SiglipVisionModel`` with the
``vision_model`` wrapper). So they go on the wire. ``save_pretrained`` (transformers 5.23, measured) writes the same
names except ``vision_tower.*`` without the wrapper, a layout no released checkpoint has. Shapes do not change.
"""

from __future__ import annotations

from vlmreg import PrefixRenames

#: (in-memory prefix, checkpoint prefix); ``model.image_newline`` is a whole name, matched as a prefix of itself.
PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.image_newline", "image_newline"),
    ("lm_head.", "language_model.lm_head."),
)

#: The descriptor's ``checkpoint_weights`` / ``memory_weights``; a name under none of the prefixes is an error.
RENAMES = PrefixRenames(PREFIXES, label="a LLaVA-OneVision")
checkpoint_weights = RENAMES.checkpoint_weights
memory_weights = RENAMES.memory_weights

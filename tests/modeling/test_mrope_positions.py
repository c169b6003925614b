"""A packed micro-batch's M-RoPE positions are, segment by segment, what the model's own ``get_rope_index`` gives for
each sample alone (the reference: transformers, called on the sample's whole row), for every Qwen family, with
samples that share a prompt (the family reuses the prompt's positions), images, several images, clips, text only,
and a row that ends in an image."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_images_across_ranks import family_samples
from vlmreg.train.batching import make_microbatches
from vlmreg.train.samples import TrainingSample

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def own_rope_index(loaded, encoder, sample: TrainingSample) -> torch.Tensor:
    """transformers' positions for ``sample`` alone, from the processor's own inputs for its images."""
    ids = torch.tensor([sample.input_ids])
    inputs = encoder.token_inputs(
        len(sample), [[(0, i, span) for i, span in zip(sample.image_ids, sample.image_spans, strict=True)]]
    )
    media = {
        k: v
        for k, v in encoder.image_inputs(sample.image_ids).items()
        if k.endswith("grid_thw") or k == "second_per_grid_ts"
    }
    rope, _ = loaded.model.base_model.get_rope_index(
        ids,
        mm_token_type_ids=inputs.get("mm_token_type_ids", torch.zeros_like(ids)),
        attention_mask=torch.ones_like(ids),
        **media,
    )
    return rope[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_positions_are_get_rope_index_per_sample(family):
    loaded, encoder, samples = family_samples(family)
    first = samples[0]
    longer = TrainingSample(  # the first sample's prompt with a longer completion: its prompt positions come again
        [*first.input_ids, *first.input_ids[-3:] * 5],
        [*first.loss_mask, *[True] * 15],
        [*first.rollout_logprobs, *[-1.0] * 15],
        first.image_ids,
        first.image_spans,
        first.advantage,
        len(samples),
        "the first prompt again",
    )
    last_image = samples[0].image_spans[-1][1]  # a row that ends with its image's last token
    cut = TrainingSample(
        first.input_ids[:last_image],
        [False] * (last_image - 1) + [True],
        first.rollout_logprobs[:last_image],
        first.image_ids,
        first.image_spans,
        1.0,
        len(samples) + 1,
        "ends in an image",
    )
    rows = [*samples, longer, cut]
    for _ in range(2):  # the second time every prompt's positions are the ones kept
        (mb,) = make_microbatches(rows, loaded.resolved, encoder, budget=10**6, packed=True, device="cpu")
        positions = mb.inputs["position_ids"]
        start = 0
        for sample in rows:
            segment = positions[:, 0, start : start + len(sample)]
            assert segment[0].tolist() == list(range(len(sample)))
            assert torch.equal(segment[1:], own_rope_index(loaded, encoder, sample)), sample.example_id
            start += len(sample)

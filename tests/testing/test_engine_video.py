"""`compare_server_video`, the video case of ``vlmreg check --engine vllm``, against a stub that answers as vLLM 0.24
would (`tests.inference.test_vllm_video.vllm_reading`): the prompt comparisons pass on vLLM's prompt and fail on one a
token short; logprobs that are not the model's fail the logprob comparison."""

from __future__ import annotations

from tests.inference.test_openai_client import Stub, answer
from tests.inference.test_vllm_video import engine_for, grid_with, load, request_for, vllm_reading
from vlmreg.data import ImageStore
from vlmreg.testing.engine_video import VIDEO_CLIP, compare_server_video
from vlmreg.testing.parity import QUESTION
from vlmreg.testing.video_parity import noise_video


def test_the_video_case_compares_vllm_s_prompt_with_the_processor_s_and_logprobs_with_a_forward():
    loaded = load("qwen3_vl")
    descriptor = loaded.resolved.descriptor
    probe = engine_for(loaded, ImageStore(), server="vllm")
    video_id = probe.store.add_video(noise_video(VIDEO_CLIP[0], VIDEO_CLIP[1], 7))  # the check's own clip
    conversation = [
        {"role": "user", "content": [{"type": "video", "video": video_id}, {"type": "text", "text": QUESTION}]}
    ]
    prompt = vllm_reading(request_for(probe, conversation), loaded.processor.tokenizer, grid_with(loaded.processor))[
        "prompt_ids"
    ]
    for ids, verdict in ((prompt, "PASS"), (prompt[1:], "FAIL")):
        stub = Stub([(200, answer(ids, [40, 41, 42]))])
        try:
            engine = engine_for(loaded, ImageStore(), url=stub.url, server="vllm")
            results = compare_server_video(engine, loaded.processor, loaded.model.float(), descriptor, 1e-3)
        finally:
            stub.close()
        status = {r.name.split(": ", 1)[1]: r.status for r in results}
        assert status["prompt ids vs the processor"] == status["prompt ids vs vlmreg"] == verdict, results
        assert stub.requests[0]["media_io_kwargs"]["video"]["num_frames"] == VIDEO_CLIP[0]
    assert status["logprobs vs a plain forward"] == "FAIL"  # -1.0 each: not the random model's

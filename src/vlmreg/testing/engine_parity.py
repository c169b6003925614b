"""Engine parity: a family served by vLLM, against references vLLM and vlmreg did not write.

``vlmreg check --engine vllm FAMILY`` (the family's tiny random model) or ``vlmreg check --engine vllm DIR`` (a local
checkpoint) starts vLLM as the trainer does (`ServerLink`, `VllmServer`: a random init written by `export_checkpoint`
after `sharpen_logits`, the trainer's flags, then `DEFAULT_SERVER_ARGS`, which ``--server-args`` replace), then for a
text-only prompt and prompts with 1, 2 and 3 images of different sizes (as many as the family takes in one message)
sends each
conversation as the trainer's `OpenAIEngine` does (images as PNG data URIs, ``return_token_ids``, ``logprobs``) and
compares:

- vLLM's prompt ids with the family's processor's own ``apply_chat_template(..., tokenize=True, return_dict=True)``
  (the independent reference), and with vlmreg's `PromptEncoder` (what the trainer builds);
- the logprobs vLLM gives its sampled tokens with one plain transformers forward of the same weights in fp32 on the
  processor's inputs (`LOGPROB_TOLERANCE` by the engine's dtype);
- the processor saved beside the checkpoint, loaded with ``AutoProcessor`` as vLLM loads it, with the trainer's;
- after the trainer's first (full) sync, a change of every language-model matrix and a step's sync into vLLM (the
  run's transport), the logprobs again.

With ``--url`` it attaches to a running OpenAI-compatible server instead (vLLM, or `vlmreg serve`), which must serve
the checkpoint DIR names; nothing is synced then. Each comparison is one `Comparison`; the report is JSON-ready.
This module launches the server, prepares the reference weights and writes the report; the text and image
comparisons are `vlmreg.testing.engine_images`'s (`compare_server`, `engine_processor_parity`, re-exported here), the
video ones `vlmreg.testing.engine_video`'s.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

import vlmreg
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry
from vlmreg.testing.engine_compare import COMPLETION_TOKENS, Comparison
from vlmreg.testing.engine_images import compare_server, engine_processor_parity, image_cases
from vlmreg.testing.engine_video import compare_server_video
from vlmreg.testing.parity import (
    IMAGE_SIZES,
    QUESTION,
    noise_image,
    processor_inputs,
    reference_attention,
    transformers_sdpa,
)

__all__ = [
    "DEFAULT_SERVER_ARGS",
    "LOGPROB_TOLERANCE",
    "Comparison",
    "EngineReport",
    "check_engine",
    "compare_server",
    "engine_config",
    "engine_processor_parity",
    "new_report",
    "sharpen_logits",
]

#: vLLM flags for the check, after the trainer's (`vllm_command`): no compile or CUDA graphs (a start in tens of
#: seconds), an attention backend that takes the tiny models' head size of 16 and fp32 (vLLM 0.24's TRITON_ATTN needs
#: a head size of at least 32, FLASH_ATTN bf16 or fp16), few sequences, and at most 3 images and 1 video per prompt
#: (a smaller start-up profile; the video case of a family that declares video, `vlmreg.testing.engine_video`).
DEFAULT_SERVER_ARGS = (
    "--enforce-eager",
    "--attention-backend",
    "FLEX_ATTENTION",
    "--max-num-seqs",
    "8",
    "--limit-mm-per-prompt",
    '{"image": 3, "video": 1}',
)
#: max |engine - plain fp32 forward| of a sampled token's logprob, by the engine's dtype (bf16: vLLM on the 2B shape
#: measured a max of 0.117 in docs/serving.md; another random model differs by about 10 after `sharpen_logits`)
LOGPROB_TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25, "float16": 0.1}
#: the mean next-token entropy (nats) the check gives a random init (`sharpen_logits`): about what logits of std 4 gave
#: a tiny random VLM, whose sampled tokens then have probabilities of 0.15-0.65
SHARP_ENTROPY = 2.5


@attrs.define
class EngineReport:
    """What `check_engine` found: every comparison, or the error that stopped it (``ok`` only when none failed)."""

    family: str
    source: str
    engine: str = "vllm"
    dtype: str = "float32"
    server_args: list[str] = attrs.field(factory=list)
    comparisons: list[Comparison] = attrs.field(factory=list)
    error: str | None = None
    launch_s: float | None = None
    seconds: float | None = None
    log: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.comparisons) and not any(c.status == "FAIL" for c in self.comparisons)

    def as_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "source": self.source,
            "engine": self.engine,
            "dtype": self.dtype,
            "ok": self.ok,
            "error": self.error,
            "launch_s": self.launch_s,
            "seconds": self.seconds,
            "server_args": self.server_args,
            "log": self.log,
            "comparisons": [c.as_dict() for c in self.comparisons],
            "passed": sum(c.status == "PASS" for c in self.comparisons),
            "failed": sum(c.status == "FAIL" for c in self.comparisons),
        }


def engine_config(
    family: str,
    checkpoint: str | None,
    *,
    dtype: str,
    server_args: Sequence[str],
    gpu_memory_fraction: float,
    launch: bool,
    device: str,
    server: str = "vllm",
    transport: str = "ipc",
    attn: str = "sdpa",
) -> dict[str, Any]:
    """The run config the check loads the model by and launches the server with (as ``vlmreg train`` would;
    ``attn``: `vlmreg.testing.parity.reference_attention`).
    ``server = "vlmreg"`` launches `vlmreg serve` instead of vLLM (the same check on a CPU, ``transport = "gloo"``)."""
    model = {"init": "pretrained", "name": checkpoint} if checkpoint else {"init": "random", "size": "tiny"}
    raw: dict[str, Any] = {
        "model": {**model, "family": family, "dtype": dtype, "attn_implementation": attn},
        "trainer": {"device": device, "seq_len": 2048},
    }
    if launch:  # an attached server needs no rollout section: only the model is loaded, as the reference
        raw["rollout"] = {"engine": "openai", "server": server, "launch": True, "max_tokens": COMPLETION_TOKENS}
        if server == "vllm":
            raw["rollout"].update(
                launch_gpu="same", gpu_memory_fraction=gpu_memory_fraction, server_args=list(server_args)
            )
        raw["broadcast"] = {"transport": transport}
    return raw


def _perturb(model: Any, prefix: str) -> None:
    """Change every language-model matrix a lot (half its std of noise), so a sync that misses a weight shows."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    generator = torch.Generator(device=model.device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(prefix) and p.dim() >= 2:
                noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32)
                p.add_((0.5 * p.float().std() * noise).to(p.dtype))


def sharpen_logits(model: Any, descriptor: Any, processor: Any, target_entropy: float = SHARP_ENTROPY) -> float:
    """Scale a random init's output head so its next-token distributions are spread but not flat (mean entropy
    ``target_entropy`` nats over a text prompt's last positions) and return the factor. A tiny random model's logits
    are near 0, so every token's logprob is near -log(vocab) and another model's logprobs would pass for the same;
    after this, a wrong weight shows. The factor is found by bisection on the measured entropy, not from the logits'
    spread: where the head is tied to the input embeddings scaling it scales the embeddings too, and the
    logit of the last input token grows with the square of the factor, so a factor chosen for a spread of 4 left one
    token with probability 1 (every logprob 0: nothing compared)."""

    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    head = model.get_submodule(descriptor.lm_head_attr)
    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if descriptor.prefix_lm:  # a prefix-LM processor writes a prompt with its image (and may refuse one without)
        content.insert(0, {"type": "image", "image": noise_image(IMAGE_SIZES[0], 0)})
    inputs = processor_inputs(processor, [{"role": "user", "content": content}])
    inputs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    original = head.weight.detach().clone()

    def entropy(factor: float) -> float:
        with torch.no_grad(), transformers_sdpa(model):
            head.weight.copy_(original * factor)
            logp = model(**inputs, use_cache=False).logits.float()[0, -8:].log_softmax(-1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    if entropy(1.0) <= target_entropy:  # already spread no wider than the target: the init as it is
        with torch.no_grad():
            head.weight.copy_(original)
        return 1.0
    low, high = 0.0, math.log(1e4)  # log factor: from 1 to 10^4
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if entropy(math.exp(middle)) > target_entropy else (low, middle)
    factor = math.exp((low + high) / 2)
    with torch.no_grad():
        head.weight.copy_(original * factor)
    return factor


def _fp32(model: Any) -> Any:
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    return model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()


def _unavailable(descriptor: Any, server: str) -> str | None:
    """Why vLLM cannot be launched here (``None``: it can)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    if server != "vllm":
        return None
    if descriptor.vllm_unsupported:
        return (
            f"family {descriptor.name} declares vLLM cannot serve it: {descriptor.vllm_unsupported} (drop "
            "vllm_unsupported to check again)"
        )
    if importlib.util.find_spec("vllm") is None:
        return (
            f'vLLM is not importable by {sys.executable}: nothing was compared (pip install "vlmreg[vllm]", or '
            "--url a running server)"
        )
    if not torch.cuda.is_available():
        return "no CUDA device: vLLM needs a GPU (or --url a running server)"
    return None


def new_report(
    family: str | None,
    checkpoint: str | None = None,
    *,
    url: str | None = None,
    dtype: str = "float32",
    server_args: Sequence[str] = DEFAULT_SERVER_ARGS,
    server: str = "vllm",
) -> EngineReport:
    """An empty report for the family (found from the checkpoint's model type when ``None``), with the ``error`` that
    stops any comparison before it starts: vLLM missing, no GPU, the family declaring vLLM cannot serve it."""

    if family is None:
        # deferred: start-up cost (loads torch)
        from vlmreg.loading.build import read_model_type  # noqa: PLC0415

        if checkpoint is None:
            raise VlmregError("an engine report needs a family, or a checkpoint to read it from")
        family = get_registry().for_model_type(read_model_type(checkpoint)).name
    descriptor = get_registry().get(family)
    source = checkpoint or f"tiny {family} (random init)"
    report = EngineReport(
        family,
        source + (f", served at {url}" if url else ""),
        engine=server if url is None else f"the server at {url}",
        dtype=dtype,
        server_args=list(server_args) if server == "vllm" and url is None else [],
    )
    if url is None:
        report.error = _unavailable(descriptor, server)
    elif checkpoint is None:
        report.error = (
            "--url needs the checkpoint DIR the server serves: a tiny random model here would not have its weights"
        )
    return report


def check_engine(
    family: str | None,
    checkpoint: str | None = None,
    *,
    url: str | None = None,
    dtype: str = "float32",
    server_args: Sequence[str] = DEFAULT_SERVER_ARGS,
    gpu_memory_fraction: float = 0.1,
    output_dir: Path | None = None,
    sync: bool = True,
    tolerance: float | None = None,
    log: Callable[[str], None] = print,
    server: str = "vllm",
    device: str | None = None,
    transport: str = "ipc",
) -> EngineReport:
    """Engine parity for one family: its tiny random model (``family``), or the checkpoint directory ``checkpoint``
    (its family found by model type unless ``family`` is given); the server launched as the trainer launches it
    (`ServerLink`: vLLM, or with ``server = "vlmreg"`` `vlmreg serve`), or the one at ``url``."""

    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs)
    from vlmreg.config import parse_config  # noqa: PLC0415
    from vlmreg.config.resolve import resolve_config  # noqa: PLC0415

    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data import ImageStore  # noqa: PLC0415

    # deferred: start-up cost (loads concurrent, http, torch, urllib.request)
    from vlmreg.inference.openai_client import OpenAIEngine  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, concurrent, http, safetensors, subprocess, torch, urllib.request)
    from vlmreg.inference.server_link import ServerLink  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, concurrent, safetensors, subprocess, torch, urllib.request)
    from vlmreg.inference.vllm_server import exports_weights  # noqa: PLC0415

    started = time.perf_counter()
    report = new_report(family, checkpoint, url=url, dtype=dtype, server_args=server_args, server=server)
    if report.error:
        return report
    family, descriptor = report.family, get_registry().get(report.family)
    tolerance = LOGPROB_TOLERANCE.get(dtype, 0.1) if tolerance is None else tolerance
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    raw = engine_config(
        family,
        checkpoint,
        dtype=dtype if url is None else "float32",
        server_args=server_args,
        gpu_memory_fraction=gpu_memory_fraction,
        launch=url is None,
        device=device,
        server=server,
        transport=transport,
        attn=reference_attention(family, checkpoint),
    )
    output_dir = Path(output_dir or Path("runs") / f"engine-check-{family}")
    rc = resolve_config(parse_config(raw))
    loaded = vlmreg.load(rc)
    model = loaded.model.eval()
    if checkpoint is None:
        factor = sharpen_logits(model, descriptor, loaded.processor)
        report.source += f", output head x{factor:.3g} for a mean next-token entropy of {SHARP_ENTROPY:g} nats"
    link, saved = None, None
    try:
        if url is None:
            launched = time.perf_counter()
            report.log = str(output_dir / ("vllm.log" if server == "vllm" else "server.log"))
            try:
                link = ServerLink(rc, loaded.resolved, loaded.device, output_dir, log, processor=loaded.processor)
                # vlmreg serve built its own random init: the trainer's first sync sends its weights
                if link.vllm_server is None:
                    link.sync(0, full=True)
            except VlmregError as exc:
                report.error = f"the {server} server did not start: {exc}"
                return report
            report.launch_s = round(time.perf_counter() - launched, 1)
            engine = OpenAIEngine(
                str(link.url),
                loaded.processor,
                ImageStore(),
                descriptor=descriptor,
                api_key=link.api_key,
                cache_scope=link.cache_scope,
                timeout_s=300.0,
                max_retries=1,
                server=server,
            )
            if link.vllm_server is not None and exports_weights(rc):  # what vLLM loaded, written by `export_checkpoint`
                comparison, saved = engine_processor_parity(output_dir / "vllm-model", loaded.processor, descriptor)
                report.comparisons.append(comparison)
        else:
            engine = OpenAIEngine(
                url,
                loaded.processor,
                ImageStore(),
                descriptor=descriptor,
                api_key=os.environ.get("VLMREG_API_KEY") or None,
                timeout_s=300.0,
                max_retries=1,
                server=server,
            )
        report.comparisons += compare_server(engine, loaded.processor, _fp32(model), descriptor, tolerance, saved=saved)
        if descriptor.max_videos_per_message and url is None:  # a launched server: the engine knows which it is
            report.comparisons += compare_server_video(engine, loaded.processor, _fp32(model), descriptor, tolerance)
        elif descriptor.max_videos_per_message:  # vLLM gets the vllm_video_wrapper, vlmreg serve must not
            why = "an attached server may be vLLM or vlmreg serve, which take a video's markup differently"
            report.comparisons.append(Comparison("1 video", "SKIP", f"videos are checked on a launched server ({why})"))
        if link is not None and sync:
            try:
                # vLLM held the checkpoint's weights until now; the trainer syncs all first
                if link.vllm_server is not None:
                    link.sync(0, full=True)
                _perturb(model, descriptor.language_model_attr + ".")
                link.sync(1)
            except VlmregError as exc:
                report.comparisons.append(Comparison(f"weight sync ({transport})", "FAIL", str(exc)))
            else:
                cases, _ = image_cases(descriptor)
                report.comparisons += compare_server(
                    engine,
                    loaded.processor,
                    _fp32(model),
                    descriptor,
                    tolerance,
                    cases=[cases[-1]],
                    label=f"after a weight sync ({transport}), ",
                )
    finally:
        if link is not None:
            link.close()
        report.seconds = round(time.perf_counter() - started, 1)
    return report

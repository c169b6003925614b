"""The run configuration: one TOML file, one attrs class per section.

Loaded strictly by `vlmreg.config.load_config` (unknown keys, wrong types and bad values are all reported
together, each with its dotted TOML path). Values a family descriptor knows (image limit, vision support,
processor, thinking defaults, LoRA preset) are left ``None`` here and filled by `vlmreg.config.resolve_config`,
which also rejects values that contradict the family. Everything here checks shapes, types and ranges only: the rules
that depend on what a named part is (a rollout engine, a transport, an objective...) are `vlmreg.config.rules`, run
once after parsing against the registered parts' declarations; no check here looks a registry up.
"""

from __future__ import annotations

import urllib.parse
from typing import Literal

import attrs

from vlmreg.config.checks import FieldProblem, Section, at_least, checks, in_range, non_empty, non_negative, positive
from vlmreg.sdk.descriptor import LORA_SCOPES

#: Seeds every random generator in use accepts (torch, Python's random, NumPy: 0 to 2**32 - 1).
SEED_RANGE = in_range(0, 2**32 - 1)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]


@attrs.frozen(kw_only=True)
class VlmSection(Section):
    """``[model.vlm]``: where the parts are (overrides of the descriptor, resolved strictly) and what is frozen."""

    vision_encoder_attr: str | None = None
    language_model_attr: str | None = None
    lm_head_attr: str | None = None
    connector_attrs: list[str] | None = None
    freeze_vision_encoder: bool = True
    freeze_connectors: bool = False

    def overrides(self) -> dict[str, object]:
        names = ("vision_encoder_attr", "language_model_attr", "lm_head_attr", "connector_attrs")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@attrs.frozen(kw_only=True)
class LoraSection(Section):
    """``[model.lora]``: present means LoRA is on. ``targets``: a preset name of the family, a list of module-name
    suffixes, or ``"re:<regex>"`` matched against full module names."""

    r: int = attrs.field(default=16, metadata=checks(positive))
    alpha: float = attrs.field(default=32.0, metadata=checks(positive))
    dropout: float = attrs.field(default=0.0, metadata=checks(in_range(0.0, 1.0, high_open=True)))
    targets: str | list[str] | None = attrs.field(default=None, metadata=checks(non_empty))
    parameters: list[str] = attrs.field(factory=list)
    scopes: list[str] | None = attrs.field(default=None, metadata=checks(non_empty))
    exclude: list[str] = attrs.field(factory=list)

    def cross_checks(self) -> list[FieldProblem]:
        bad = [s for s in self.scopes or () if s not in LORA_SCOPES]
        if bad:
            return [FieldProblem("scopes", f"may only name {', '.join(LORA_SCOPES)}", bad[0])]
        return []


@attrs.frozen(kw_only=True)
class ModelSection(Section):
    """``[model]``: a local checkpoint directory (or a Hub id already in the local cache), or a random init.

    ``size`` picks the random init's shape: ``tiny`` (the descriptor's ``tiny_config``) or one of its ``shapes``;
    ``layers`` keeps only the shape's first N decoder layers (the same shape, shallower: for a small machine).
    ``processor`` is a local directory or cached Hub id; by default the checkpoint's own, else the family's.
    """

    name: str | None = attrs.field(default=None, metadata=checks(non_empty))
    init: Literal["pretrained", "random"] = "pretrained"
    family: str | None = None
    size: str = attrs.field(default="tiny", metadata=checks(non_empty))
    layers: int | None = attrs.field(default=None, metadata=checks(positive))
    processor: str | None = attrs.field(default=None, metadata=checks(non_empty))
    dtype: Dtype = "auto"
    attn_implementation: Literal["varlen", "sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "varlen"
    seed: int = attrs.field(default=0, metadata=checks(SEED_RANGE))
    vlm: VlmSection = attrs.field(factory=VlmSection)
    lora: LoraSection | None = None

    def cross_checks(self) -> list[FieldProblem]:
        if self.init == "random" and self.family is None:
            return [FieldProblem("family", 'is required with init = "random" (which family to build)', None)]
        if self.init == "random" and self.name is not None:
            return [
                FieldProblem("name", 'names a checkpoint, but init = "random" builds one; drop one of them', self.name)
            ]
        if self.init == "pretrained" and self.layers is not None:
            problem = 'cuts a random init\'s shape; a checkpoint keeps its own (set init = "random")'
            return [FieldProblem("layers", problem, self.layers)]
        if self.init == "pretrained" and self.name is None:
            return [
                FieldProblem(
                    "name", 'is required: a local checkpoint directory or cached Hub id (or set init = "random")', None
                )
            ]
        return []


@attrs.frozen(kw_only=True)
class RolloutSection(Section):
    """``[rollout]``: sampling. ``None`` values come from the family descriptor.

    ``engine``: a registered rollout engine; ``openai`` (or a plugin's that declares ``server = True``) sends
    conversations to an OpenAI-compatible server at ``url`` (`vlmreg serve`, vLLM);
    ``launch`` has ``vlmreg train`` start that server itself (``server``: which one), as a separate process:
    on the trainer's GPU (``launch_gpu = "same"``, with ``gpu_memory_fraction`` of its memory) or the next one.
    ``server_args`` are extra command-line arguments for a launched vLLM. ``servers`` launches that many servers (each
    with its own GPUs after every trainer rank); attached servers are listed in ``url`` (a string or a list of them).
    A step's prompt groups are spread over the servers, and one weight sync reaches them all. ``share_prompts``: a
    group's identical requests go to its server as one request with ``n`` (``false``: one request per conversation).
    """

    engine: str = attrs.field(default="embedded", metadata=checks(non_empty))
    server: Literal["vlmreg", "vllm"] = "vlmreg"
    url: str | list[str] | None = attrs.field(default=None, metadata=checks(non_empty))
    launch: bool = False
    servers: int = attrs.field(default=1, metadata=checks(positive))
    launch_gpu: Literal["same", "next"] = "next"
    gpu_memory_fraction: float | None = attrs.field(
        default=None, metadata=checks(in_range(0.0, 1.0, low_open=True, high_open=True))
    )
    launch_timeout_s: float = attrs.field(default=900.0, metadata=checks(positive))
    server_args: list[str] = attrs.field(factory=list)
    request_timeout_s: float = attrs.field(default=120.0, metadata=checks(positive))
    max_retries: int = attrs.field(default=3, metadata=checks(non_negative))
    share_prompts: bool = True
    use_vision: bool | None = None
    max_images_per_step: int | None = attrs.field(default=None, metadata=checks(non_negative))
    image_only_mode: bool = False
    thinking_mode: str | None = None
    thinking_budget: int | None = attrs.field(default=None, metadata=checks(positive))
    group_size: int = attrs.field(default=8, metadata=checks(at_least(2)))
    temperature: float = attrs.field(default=1.0, metadata=checks(positive))
    top_p: float = attrs.field(default=1.0, metadata=checks(in_range(0.0, 1.0, low_open=True)))
    max_tokens: int = attrs.field(default=256, metadata=checks(positive))
    max_concurrent_rollouts: int = attrs.field(default=64, metadata=checks(positive))
    # environments (docs/environments.md): which one, where it runs, how long a call may take, the image budget
    environment: str | None = attrs.field(default=None, metadata=checks(non_empty))
    env_url: str | None = attrs.field(default=None, metadata=checks(non_empty))
    env_api_key_env: str = attrs.field(default="VLMREG_ENV_API_KEY", metadata=checks(non_empty))
    env_timeout_s: float = attrs.field(default=60.0, metadata=checks(positive))
    env_concurrency: int = attrs.field(default=32, metadata=checks(positive))
    env_retries: int = attrs.field(default=3, metadata=checks(non_negative))
    max_images_in_context: int | None = attrs.field(default=None, metadata=checks(non_negative))
    max_videos_in_context: int | None = attrs.field(default=None, metadata=checks(non_negative))
    max_turns: int = attrs.field(default=8, metadata=checks(positive))

    def cross_checks(self) -> list[FieldProblem]:
        if self.env_url is not None and not self.env_url.startswith(("http://", "https://")):
            return [FieldProblem("env_url", "must start with http:// or https://", self.env_url)]
        if self.launch and self.url is not None:
            return [FieldProblem("url", "is chosen by the trainer when launch = true; drop one of them", self.url)]
        for index, url in enumerate(self.urls):
            if not url.startswith(("http://", "https://")):
                where = "url" if isinstance(self.url, str) else f"url[{index}]"
                return [FieldProblem(where, "must start with http:// or https://", url)]
        if len(set(self.urls)) < len(self.urls):
            return [FieldProblem("url", "lists a server twice", self.url)]
        if self.servers > 1 and not self.launch:
            return [
                FieldProblem(
                    "servers",
                    "counts the servers the trainer launches (launch = true); list attached servers in rollout.url",
                    self.servers,
                )
            ]
        return []

    @property
    def urls(self) -> list[str]:
        """The attached servers' URLs (``url`` as a list; empty when the trainer launches its servers)."""
        if self.url is None:
            return []
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @property
    def server_count(self) -> int:
        """How many rollout servers the run uses: ``servers`` launched, or the attached ``url`` entries."""
        return self.servers if self.launch else max(len(self.urls), 1)


@attrs.frozen(kw_only=True)
class TrainerSection(Section):
    """``[trainer]``: the policy update."""

    algorithm: str = attrs.field(default="grpo", metadata=checks(non_empty))
    steps: int = attrs.field(default=100, metadata=checks(positive))
    prompts_per_step: int = attrs.field(default=8, metadata=checks(positive))
    learning_rate: float = attrs.field(default=1e-5, metadata=checks(positive))
    weight_decay: float = attrs.field(default=0.0, metadata=checks(non_negative))
    compensated_updates: bool = True
    max_grad_norm: float = attrs.field(default=1.0, metadata=checks(positive))
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = attrs.field(default=0, metadata=checks(non_negative))
    min_lr_ratio: float = attrs.field(default=0.0, metadata=checks(in_range(0.0, 1.0)))
    updates_per_batch: int = attrs.field(default=1, metadata=checks(positive))
    entropy_coef: float = attrs.field(default=0.0, metadata=checks(non_negative))
    mask_truncated: bool = False
    loss_aggregation: (
        Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] | None
    ) = None
    clip_low: float | None = attrs.field(default=None, metadata=checks(in_range(0.0, 1.0, low_open=True)))
    clip_high: float | None = attrs.field(default=None, metadata=checks(positive))
    normalize_advantage_std: bool = True
    tis: bool = True
    tis_cap: float = attrs.field(default=2.0, metadata=checks(at_least(1.0)))
    tis_level: Literal["token", "sequence", "geometric"] | None = None
    tis_mode: Literal["truncate", "mask"] = "truncate"
    max_off_policy_steps: int = attrs.field(default=0, metadata=checks(non_negative))
    kl_coef: float = attrs.field(default=0.0, metadata=checks(non_negative))
    seq_len: int = attrs.field(default=2048, metadata=checks(positive))
    max_tokens_per_microbatch: int = attrs.field(default=8192, metadata=checks(positive))
    packing: bool = True
    overlong: Literal["truncate", "drop"] = "truncate"
    format_warmup_steps: int = attrs.field(default=0, metadata=checks(non_negative))
    gradient_checkpointing: bool = False
    memory_budget_gib: float | None = attrs.field(default=None, metadata=checks(positive))
    compile: bool = False
    fsdp_prefetch_layers: int = attrs.field(default=2, metadata=checks(non_negative))
    device: Device = "auto"
    seed: int = attrs.field(default=0, metadata=checks(SEED_RANGE))
    output_dir: str = attrs.field(default="runs/vlmreg", metadata=checks(non_empty))
    save_every: int = attrs.field(default=0, metadata=checks(non_negative))

    def cross_checks(self) -> list[FieldProblem]:
        if self.max_tokens_per_microbatch < self.seq_len:
            return [
                FieldProblem(
                    "max_tokens_per_microbatch",
                    f"must be >= seq_len ({self.seq_len}) so one sample fits",
                    self.max_tokens_per_microbatch,
                )
            ]
        if self.warmup_steps > self.steps:
            return [
                FieldProblem(
                    "warmup_steps", f"must be <= steps ({self.steps}): the warm-up would never end", self.warmup_steps
                )
            ]
        if self.memory_budget_gib is not None and self.gradient_checkpointing:
            return [
                FieldProblem(
                    "memory_budget_gib",
                    "chooses which layers recompute their activations; gradient_checkpointing = true "
                    "recomputes all of them: set one of the two",
                    self.memory_budget_gib,
                )
            ]
        return []


def _folder_paths(value: list[str]) -> str | None:
    """Every item a non-empty string (a folder path); whether it exists is checked by resolution."""
    for index, item in enumerate(value):
        if not isinstance(item, str):
            return f"item [{index}] must be a folder path string, not {type(item).__name__}"
        if not item.strip():
            return f"item [{index}] must not be empty"
    return None


def _host_names(value: list[str]) -> str | None:
    """Every item a host name, or ``name:port`` (``[v6]`` or ``[v6]:port``): no scheme, path or user."""

    for index, item in enumerate(value):
        if not isinstance(item, str):
            return f"item [{index}] must be a host name string, not {type(item).__name__}"
        parts = urllib.parse.urlsplit("//" + item.strip())
        try:
            _ = parts.port  # raises ValueError for a port that is not a number
        except ValueError:
            return f"item [{index}] ({item!r}) has a port that is not a number from 0 to 65535"
        if not parts.hostname or any(c in item for c in "/@?#") or not item.strip():
            return f"item [{index}] ({item!r}) must be a host name or host:port (no scheme or path)"
    return None


@attrs.frozen(kw_only=True)
class DataSection(Section):
    """``[data]``: where prompts and images come from.

    ``image_roots``: folders (relative ones: to the config file's folder) that local image paths in the dataset
    files may point into, besides each dataset file's own folder; any other path is refused.
    """

    task: str | None = None
    format: Literal["messages", "placeholder"] = "messages"
    paths: list[str] = attrs.field(factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_keys: list[str] = attrs.field(factory=lambda: ["images"])
    image_roots: list[str] = attrs.field(factory=list, metadata=checks(_folder_paths))
    system_prompt: str | None = None
    on_bad_image: Literal["error", "skip"] = "error"
    allow_http: bool = False
    http_timeout_s: float = attrs.field(default=10.0, metadata=checks(positive))
    http_redirect_hosts: list[str] = attrs.field(factory=list, metadata=checks(_host_names))
    max_image_bytes: int = attrs.field(default=20_000_000, metadata=checks(positive))
    max_image_pixels: int = attrs.field(default=40_000_000, metadata=checks(positive))
    # videos (docs/data.md "Videos"): how frames are taken (unset: the family's default) and what a video may be
    video_fps: float | None = attrs.field(default=None, metadata=checks(positive))
    video_max_frames: int | None = attrs.field(default=None, metadata=checks(positive))
    video_max_pixels: int | None = attrs.field(default=None, metadata=checks(positive))
    max_video_bytes: int = attrs.field(default=200_000_000, metadata=checks(positive))
    max_video_seconds: float = attrs.field(default=600.0, metadata=checks(positive))
    max_video_frames: int = attrs.field(default=256, metadata=checks(positive))
    num_samples: int | None = attrs.field(default=None, metadata=checks(positive))
    seed: int = attrs.field(default=0, metadata=checks(SEED_RANGE))

    def cross_checks(self) -> list[FieldProblem]:
        if self.task is not None and self.paths:
            return [FieldProblem("paths", "names files, but task is set too; use one source", self.paths)]
        if self.task is None and not self.paths:
            return [FieldProblem("paths", "is empty: list dataset files, or set task to a bundled task", self.paths)]
        return []


@attrs.frozen(kw_only=True)
class RewardSection(Section):
    """``[reward]``: reward functions and their weights; unset: the task's own reward."""

    functions: dict[str, float] | None = attrs.field(default=None, metadata=checks(non_empty))


@attrs.frozen(kw_only=True)
class BroadcastSection(Section):
    """``[broadcast]``: how new weights reach an inference engine that runs apart (none: the embedded engine).

    ``transport``: a registered transport (`vlmreg plugins` lists them; vlmreg's own: gloo, nccl, filesystem, ipc), or
    ``"none"``; which ``[rollout]`` settings it takes comes from its declared properties (`vlmreg.Transport`).

    ``vllm_load``: ``"reload"`` drives each sync through vLLM's weight-transfer API (layerwise reload, then finalize:
    right for every checkpoint, quantized ones included); ``"direct"`` hands the tensors straight to the model's
    ``load_weights`` (faster; only for checkpoints whose weights vLLM does not process after loading).

    ``vllm_push``: with ``transport = "ipc"``, ``vllm_load = "direct"`` and a vLLM launched by the trainer, later syncs
    are written into vLLM's weights by the trainer itself, from the copy plan vLLM's worker recorded (no request per
    sync); ``false`` sends every sync through vLLM.

    ``vllm_early_receive``: with ``vllm_load = "direct"`` and a process-group transport, in the synchronous loop, vLLM's
    workers are asked to receive a step's sync as soon as its rollouts are collected, so the request travels during
    the update and the sync starts at once (`vlmreg.inference.vllm_rpc`); vLLM then takes no other request until the
    sync: ``"launched"`` for a server the trainer launched (no other client), ``"always"`` for attached ones too,
    ``"never"``.

    ``lora_sync``: with ``[model.lora]``, ``"adapters"`` sends each sync's LoRA factors as adapters (megabytes) for
    every module the server serves as LoRA, merging only the rest into base weights (per module, logged);
    ``"merged"`` merges every adapter and sends whole weights, as for a model without LoRA; ``"auto"`` (the default)
    is ``"adapters"`` (vLLM's live adapter syncs have their GPU figures: BENCHMARKS.md).
    """

    transport: str = attrs.field(default="none", metadata=checks(non_empty))
    bucket_mb: int = attrs.field(default=512, metadata=checks(positive))
    timeout_s: float = attrs.field(default=120.0, metadata=checks(positive))
    checksum: bool = False
    host: str = attrs.field(default="127.0.0.1", metadata=checks(non_empty))
    port: int = attrs.field(default=0, metadata=checks(in_range(0, 65535)))
    directory: str | None = attrs.field(default=None, metadata=checks(non_empty))
    vllm_load: Literal["reload", "direct"] = "reload"
    vllm_push: bool = True
    vllm_early_receive: Literal["launched", "always", "never"] = "launched"
    lora_sync: Literal["auto", "adapters", "merged"] = "auto"


@attrs.frozen(kw_only=True)
class LoggingSection(Section):
    """``[logging]``: what the run writes besides checkpoints."""

    tensorboard: bool = True
    sinks: list[str] = attrs.field(factory=list)
    rollout_page_every: int = attrs.field(default=10, metadata=checks(non_negative))


@attrs.frozen(kw_only=True)
class EvalSection(Section):
    """``[eval]``: a held-out split scored with greedy decoding every ``every`` steps (0: only by `vlmreg eval`)."""

    every: int = attrs.field(default=0, metadata=checks(non_negative))
    num_samples: int = attrs.field(default=64, metadata=checks(positive))
    seed: int = attrs.field(default=1_000_003, metadata=checks(SEED_RANGE))
    paths: list[str] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class RunConfig(Section):
    """A whole run: every section, each with defaults."""

    model: ModelSection
    rollout: RolloutSection = attrs.field(factory=RolloutSection)
    trainer: TrainerSection = attrs.field(factory=TrainerSection)
    data: DataSection = attrs.field(factory=lambda: DataSection(task="colour"))
    reward: RewardSection = attrs.field(factory=RewardSection)
    eval: EvalSection = attrs.field(factory=EvalSection)

    broadcast: BroadcastSection = attrs.field(factory=BroadcastSection)
    logging: LoggingSection = attrs.field(factory=LoggingSection)

"""Dataset files -> `Example`s: JSONL or Parquet, in the ``messages`` or the ``placeholder`` layout.

``messages``: each record holds OpenAI chat messages (``messages``, or ``prompt`` as SkyRL writes it) whose
content parts may be images (``image_url`` or ``image``), and an answer (``answer`` or
``reward_spec.ground_truth``). ``placeholder``: the geo3k layout, a prompt column with ``<image>``
placeholders, image columns, and an answer column. Images are decoded safely (`decode_image`) and put in
the `ImageStore`; examples hold image ids. Records are named ``path:line`` (JSONL, from 1) or ``path:row``
(Parquet, from 0) in every error, so a bad one can be found.

Local image paths are confined: a path (or ``file://`` URI) in a record is resolved against its dataset file's
folder, symlinks followed, and must land inside that folder or one of ``[data] image_roots``; anything else is
refused (`ImagePathError`, whatever ``on_bad_image`` says) before it is opened.

Reading the files into records (JSONL, Parquet, the depth limit, `DataError`) is `vlmreg.data.dataset_files`'s; its
public names are re-exported here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.data.dataset_files import (
    MAX_RECORD_DEPTH,
    DataError,
    data_path,
    image_roots,
    read_records,
    value_kind,
)
from vlmreg.data.images import ImageError, ImageLimits, ImagePathError, ImageSource, decode_image
from vlmreg.data.store import ImageStore
from vlmreg.data.video import VideoLimits, decode_video
from vlmreg.sdk.example import Example, image_part, text_part
from vlmreg.sdk.video import DEFAULT_VIDEO_SAMPLING, VideoSampling, video_part

if TYPE_CHECKING:
    from vlmreg.config.schema import DataSection

__all__ = [
    "IMAGE_PLACEHOLDER",
    "MAX_RECORD_DEPTH",
    "DataError",
    "LoadedData",
    "SkippedRecord",
    "image_roots",
    "load_examples",
    "read_records",
    "run_video_sampling",
]

IMAGE_PLACEHOLDER = "<image>"
_GROUND_TRUTH = "reward_spec.ground_truth"
log = logging.getLogger(__name__)


@attrs.frozen
class SkippedRecord:
    """A record dropped under ``on_bad_image = "skip"``: its id and why (the field and the image problem)."""

    record: str
    reason: str


@attrs.frozen
class LoadedData:
    """The examples a dataset gave, in file order, and the records skipped for bad images."""

    examples: list[Example]
    skipped: list[SkippedRecord]


def load_examples(
    section: DataSection,
    store: ImageStore,
    *,
    base_dir: str | Path | None = None,
    video_sampling: VideoSampling | None = None,
) -> LoadedData:
    """Read every file in ``section.paths`` (relative to ``base_dir``, the config's folder; default: the cwd).

    Stops after ``section.num_samples`` examples (skipped records do not count). A malformed record is
    always a `DataError`; a bad image is an `ImageError` with ``on_bad_image = "error"`` and a
    `SkippedRecord` with ``"skip"``. Raises `DataError` too when no example is left. Local image paths must
    resolve inside the dataset file's folder or a ``section.image_roots`` folder (relative ones: to ``base_dir``);
    one that does not is an `ImagePathError` in both modes. ``video_sampling``: the family's default for video
    frames, under the run's ``[data] video_*`` keys and each record's own options (`run_video_sampling`).
    """
    if not section.paths:
        raise DataError("[data] paths is empty: list JSONL or Parquet files")
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    parse = _parse_messages_record if section.format == "messages" else _parse_placeholder_record
    examples: list[Example] = []
    skipped: list[SkippedRecord] = []
    extra_roots = image_roots(section, base)
    sampling = run_video_sampling(section, video_sampling)
    for shown in section.paths:
        path = data_path(shown, base)
        roots = (path.parent.resolve(), *extra_roots)
        limits = ImageLimits.from_section(section, base_dir=path.parent, roots=roots)
        video_limits = VideoLimits.from_section(section, limits)
        for record_id, record in read_records(path, shown):
            if section.num_samples is not None and len(examples) >= section.num_samples:
                break
            draft = parse(record, record_id, section)
            try:
                examples.append(draft.realise(store, limits, video_limits, sampling))
            except ImageError as exc:
                if section.on_bad_image == "error" or isinstance(exc, ImagePathError):
                    raise
                skipped.append(SkippedRecord(record_id, f"{draft.field}: {exc.reason}"))
                log.warning("skipped %s", exc)
    if not examples:
        if skipped:
            first = skipped[0]
            raise DataError(
                f"every record was skipped for a bad image ({len(skipped)}); the first: {first.record} {first.reason}"
            )
        raise DataError(f"no records in {', '.join(section.paths)}")
    return LoadedData(examples, skipped)


def run_video_sampling(section: DataSection, family: VideoSampling | None = None) -> VideoSampling:
    """How a run takes video frames: ``[data] video_fps`` / ``video_max_frames`` / ``video_max_pixels``, each unset one
    from the family's default, then from `DEFAULT_VIDEO_SAMPLING`."""
    run = VideoSampling(fps=section.video_fps, max_frames=section.video_max_frames, max_pixels=section.video_max_pixels)
    return run.over((family or VideoSampling()).over(DEFAULT_VIDEO_SAMPLING))


# -- records --------------------------------------------------------------------------------------------
@attrs.define
class _Draft:
    """A parsed record whose image parts still hold an index into ``sources`` (decoded only when all parse)."""

    record_id: str
    messages: list[dict[str, Any]]
    answer: Any
    metadata: dict[str, Any]
    sources: list[tuple[ImageSource, str]] = attrs.field(factory=list)
    videos: list[tuple[Any, str, VideoSampling]] = attrs.field(factory=list)
    field: str = ""  # the field of the image being decoded, for a SkippedRecord

    def add_image(self, source: Any, field: str) -> dict[str, Any]:
        if not isinstance(source, (str, bytes, bytearray, memoryview)) or not source:
            expected = "an image (bytes, base64, data: URI, path or URL)"
            raise DataError(f"{self.record_id} {field}: expected {expected}, got {value_kind(source)}")
        self.sources.append((source, field))
        return {"type": "image", "image": len(self.sources) - 1}

    def add_video(self, source: Any, field: str, sampling: VideoSampling) -> dict[str, Any]:
        frames = (
            isinstance(source, list)
            and source
            and all(isinstance(f, (str, bytes, bytearray, memoryview)) and f for f in source)
        )
        if not frames and (not isinstance(source, (str, bytes, bytearray, memoryview)) or not source):
            expected = "a video (path, URL, data: URI, or a non-empty array of frame images)"
            raise DataError(f"{self.record_id} {field}: expected {expected}, got {value_kind(source)}")
        self.videos.append((source, field, sampling))
        return {"type": "video", "video": len(self.videos) - 1}

    def realise(
        self,
        store: ImageStore,
        limits: ImageLimits,
        video_limits: VideoLimits | None = None,
        sampling: VideoSampling = DEFAULT_VIDEO_SAMPLING,
    ) -> Example:
        """Decode every image and video (all before storing any, so a skipped record leaves nothing behind), then
        build."""
        images, videos = [], []
        for source, field in self.sources:
            self.field = field
            images.append(decode_image(source, limits=limits, where=f"{self.record_id} {field}"))
        for source, field, own in self.videos:
            self.field = field
            where = f"{self.record_id} {field}"
            videos.append(
                decode_video(
                    source, limits=video_limits or VideoLimits(images=limits), sampling=own.over(sampling), where=where
                )
            )
        ids = [store.add(image) for image in images]
        video_ids = [store.add_video(video) for video in videos]

        def part(p: dict[str, Any]) -> dict[str, Any]:
            return (
                image_part(ids[p["image"]])
                if p["type"] == "image"
                else video_part(video_ids[p["video"]])
                if p["type"] == "video"
                else p
            )

        messages = [
            {**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list) else m
            for m in self.messages
        ]
        return Example(self.record_id, messages, self.answer, metadata=self.metadata)


def _require_object(record: Any, record_id: str) -> Mapping[str, Any]:
    if not isinstance(record, Mapping):
        raise DataError(f"{record_id}: record is {value_kind(record)}, expected an object")
    return record


def _lookup(record: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """``record[key]``, or with a dotted key the nested value (``reward_spec.ground_truth``); null counts as absent."""
    if key in record:
        return record[key] is not None, record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            return False, None
        value = value[part]
    return True, value


def _answer(record: Mapping[str, Any], record_id: str, keys: tuple[str, ...]) -> tuple[Any, str]:
    """The answer and the key it came from (a dotted key's parent stays in the metadata)."""
    for key in keys:
        found, value = _lookup(record, key)
        if found:
            _check_answer(value, record_id, key)
            return value, key
    expected = " or ".join(repr(k) for k in keys)
    raise DataError(f"{record_id}: no answer: expected key {expected} (keys: {', '.join(map(str, record)) or 'none'})")


def _check_answer(answer: Any, record_id: str, key: str) -> None:
    """An answer the reward functions can read: a string, a finite number, a boolean or an array of such, or an
    object with an ``answer`` key (``multiple_choice`` also reads ``choices``); never NaN or infinity anywhere."""
    pending = [(answer, key)]
    while pending:
        value, where = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(
                f"{record_id} {where}: the answer is {value!r}, which no reward can compare; give a number or a string"
            )
        if isinstance(value, Mapping):
            pending += [(v, f"{where}.{k}") for k, v in value.items()]
        elif isinstance(value, list):
            pending += [(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(answer, Mapping) and answer.get("answer") is None:
        raise DataError(
            f"{record_id} {key}: the answer is an object without an 'answer' key (keys: "
            f"{', '.join(map(str, answer)) or 'none'}); "
            'the reward functions read the answer from there: give a string or number, or {"answer": ..., ...}'
        )
    if isinstance(answer, Mapping) and isinstance(answer["answer"], Mapping):
        raise DataError(f"{record_id} {key}.answer: expected a string, number or array, got an object")


def _with_system_prompt(
    messages: list[dict[str, Any]], system_prompt: str | None, record_id: str, key: str
) -> list[dict[str, Any]]:
    if system_prompt is None:
        return messages
    if messages and messages[0]["role"] == "system":
        raise DataError(
            f"{record_id} {key}[0]: the record has its own system message and [data] system_prompt is set; keep one"
        )
    return [{"role": "system", "content": system_prompt}, *messages]


def _message_list(value: Any, record_id: str, key: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{record_id} {key}: expected a non-empty array of chat messages, got {value_kind(value)}")
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise DataError(f"{record_id} {key}[{i}]: expected a message object, got {value_kind(message)}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise DataError(
                f"{record_id} {key}[{i}].role: expected a role string, got {value_kind(message.get('role'))}"
            )
        if "content" not in message:
            raise DataError(f"{record_id} {key}[{i}]: no 'content'")
    return value


# -- the messages layout ----------------------------------------------------------------------------------
def _parse_messages_record(record: Any, record_id: str, section: DataSection) -> _Draft:
    record = _require_object(record, record_id)
    present = [k for k in ("messages", "prompt") if k in record]
    if not present:
        raise DataError(f"{record_id}: no 'messages' (or 'prompt') key (keys: {', '.join(map(str, record)) or 'none'})")
    if len(present) == 2:
        raise DataError(f"{record_id}: has both 'messages' and 'prompt' (its alias); keep one")
    key = present[0]
    answer, answer_key = _answer(record, record_id, (section.answer_key, _GROUND_TRUTH))
    metadata = {k: v for k, v in record.items() if k not in (key, answer_key)}
    draft = _Draft(record_id, [], answer, metadata)
    for i, message in enumerate(_message_list(record[key], record_id, key)):
        content = message["content"]
        if isinstance(content, list):
            content = [_parse_part(part, f"{key}[{i}].content[{j}]", draft) for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise DataError(
                f"{record_id} {key}[{i}].content: expected a string or an array of parts, got {value_kind(content)}"
            )
        draft.messages.append({"role": message["role"], "content": content})
    draft.messages = _with_system_prompt(draft.messages, section.system_prompt, record_id, key)
    return draft


def _parse_part(part: Any, field: str, draft: _Draft) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        raise DataError(f"{draft.record_id} {field}: expected a content part object, got {value_kind(part)}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise DataError(f"{draft.record_id} {field}.text: expected a string, got {value_kind(part.get('text'))}")
        return text_part(part["text"])
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str):
            expected = 'a URL string or {"url": ...}'
            raise DataError(f"{draft.record_id} {field}.image_url: expected {expected}, got {value_kind(value)}")
        return draft.add_image(url, f"{field}.image_url")
    if kind == "image":
        return draft.add_image(_cell_source(part.get("image"), draft.record_id, f"{field}.image"), f"{field}.image")
    if kind in ("video", "video_url"):
        value = part.get(kind)
        if kind == "video_url":
            value = value.get("url") if isinstance(value, Mapping) else value
        elif isinstance(value, list):
            value = [_cell_source(frame, draft.record_id, f"{field}.video[{n}]") for n, frame in enumerate(value)]
        return draft.add_video(value, f"{field}.{kind}", _part_sampling(part, draft.record_id, field))
    expected = "'text', 'image_url', 'image', 'video' or 'video_url'"
    raise DataError(f"{draft.record_id} {field}.type: unknown content part type {kind!r}; expected {expected}")


def _part_sampling(part: Mapping[str, Any], record_id: str, field: str) -> VideoSampling:
    """A video part's own ``fps`` / ``max_frames`` / ``max_pixels`` (unset ones left to the run and the family)."""
    values: dict[str, Any] = {}
    for key, kind in (("fps", (int, float)), ("max_frames", int), ("max_pixels", int)):
        value = part.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, kind)
            or not value > 0
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            raise DataError(
                f"{record_id} {field}.{key}: expected a positive {'number' if key == 'fps' else 'integer'}, got "
                f"{value!r}"
            )
        values[key] = value
    return VideoSampling(**values)


# -- the placeholder (geo3k) layout ---------------------------------------------------------------------------
def _cell_source(value: Any, record_id: str, field: str) -> Any:
    """An image cell as Hugging Face datasets writes it (``{"bytes": ..., "path": ...}``) -> its bytes, else its
    path."""
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return value["bytes"]
        if value.get("path"):
            return value["path"]
        raise DataError(f"{record_id} {field}: image object has neither 'bytes' nor 'path'")
    return value


def _parse_placeholder_record(record: Any, record_id: str, section: DataSection) -> _Draft:
    record = _require_object(record, record_id)
    key = section.prompt_key
    if key not in record:
        raise DataError(f"{record_id}: no prompt column {key!r} (columns: {', '.join(map(str, record)) or 'none'})")
    turns = _placeholder_turns(record[key], record_id, key)
    answer, answer_key = _answer(record, record_id, (section.answer_key,))
    used = {key, answer_key, *section.image_keys}
    draft = _Draft(record_id, [], answer, {k: v for k, v in record.items() if k not in used})
    images = _image_cells(record, record_id, section.image_keys)
    count = sum(text.count(IMAGE_PLACEHOLDER) for _, text in turns)
    if count and count != len(images):
        raise DataError(
            f"{record_id} {key}: {count} {IMAGE_PLACEHOLDER} placeholder{'s' if count != 1 else ''} but "
            f"{len(images)} image{'s' if len(images) != 1 else ''} in {', '.join(section.image_keys)}"
        )
    pending = iter(images)
    for role, text in turns:
        if not count and images and role == "user" and not draft.sources:
            # No placeholder: every image goes before the text of the first user message.
            pictures = [draft.add_image(*image) for image in images]
            content: str | list[dict[str, Any]] = pictures + ([text_part(text)] if text else [])
        elif IMAGE_PLACEHOLDER in text:
            content = []
            for n, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
                content += [draft.add_image(*next(pending))] if n else []
                content += [text_part(piece)] if piece else []
        else:
            content = text
        draft.messages.append({"role": role, "content": content})
    if images and not draft.sources:
        raise DataError(f"{record_id} {key}: {len(images)} image(s) but no user message to put them in")
    draft.messages = _with_system_prompt(draft.messages, section.system_prompt, record_id, key)
    return draft


def _placeholder_turns(prompt: Any, record_id: str, key: str) -> list[tuple[str, str]]:
    """``(role, text)`` of each message: a string prompt is one user message; a chat prompt (verl) is checked."""
    if isinstance(prompt, str):
        return [("user", prompt)]
    turns = []
    for i, message in enumerate(_message_list(prompt, record_id, key)):
        if not isinstance(message["content"], str):
            got = value_kind(message["content"])
            expected = f"a string with {IMAGE_PLACEHOLDER} placeholders"
            raise DataError(f"{record_id} {key}[{i}].content: expected {expected}, got {got}")
        turns.append((message["role"], message["content"]))
    return turns


def _image_cells(record: Mapping[str, Any], record_id: str, image_keys: list[str]) -> list[tuple[Any, str]]:
    """Every image of the record's image columns, in column order, each with its field name."""
    images: list[tuple[Any, str]] = []
    for column in image_keys:
        if column not in record:
            raise DataError(f"{record_id}: no image column {column!r} (columns: {', '.join(map(str, record))})")
        cell = record[column]
        if cell is None:
            continue
        if isinstance(cell, (list, tuple)):
            images += [
                (_cell_source(item, record_id, f"{column}[{n}]"), f"{column}[{n}]") for n, item in enumerate(cell)
            ]
        else:
            images.append((_cell_source(cell, record_id, column), column))
    return images

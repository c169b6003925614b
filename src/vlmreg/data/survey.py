"""Read a run's dataset files as training would, and report every bad record and image instead of stopping at the
first (`vlmreg validate --data`).

Each record goes through the loader's own parsing (`vlmreg.data.datasets`) and each image through `decode_image`
with the limits and folder confinement the run uses; nothing is kept (no image store). A malformed JSONL line is
reported and reading goes on with the next line; an unreadable Parquet file is reported once. Records past
``num_samples`` good examples are not read, as the run does not read them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.data import datasets
from vlmreg.data.dataset_files import DataError, data_path, image_roots, jsonl_records, read_records
from vlmreg.data.images import ImageError, ImageLimits, ImagePathError, decode_image
from vlmreg.data.video import VideoLimits, decode_video

if TYPE_CHECKING:
    from vlmreg.config.schema import DataSection

__all__ = ["DataSurvey", "survey_files"]


@attrs.define
class DataSurvey:
    """What reading the files found: counts, every problem (one line each, naming file, record and field), and the
    records that ``on_bad_image = "skip"`` would drop (the run goes on without them)."""

    files: int = 0
    records: int = 0
    images: int = 0
    examples: int = 0
    problems: list[str] = attrs.field(factory=list)
    skipped: list[str] = attrs.field(factory=list)


def _records(path: Path, shown: str, survey: DataSurvey) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() == ".parquet":
        try:
            yield from read_records(path, shown)
        except DataError as exc:
            survey.problems.append(str(exc))
    else:
        yield from jsonl_records(path, shown, on_error=lambda error: survey.problems.append(str(error)))


def _images_per_message(draft: Any, limit: int, family: str, kind: str = "image") -> list[str]:
    out = []
    for index, message in enumerate(draft.messages):
        content = message["content"]
        count = 0 if isinstance(content, str) else sum(1 for part in content if part.get("type") == kind)
        if count and not limit and kind == "video":
            out.append(
                f"{draft.record_id}: messages[{index}] carries a video, but family {family} takes no video input"
            )
        elif count > limit:
            out.append(
                f"{draft.record_id}: messages[{index}] carries {count} {kind}s; family {family} takes at most {limit} "
                "per message"
            )
    return out


def survey_files(
    section: DataSection,
    paths: Sequence[str],
    *,
    base_dir: str | Path,
    num_samples: int | None = None,
    max_images_per_message: int | None = None,
    family: str = "",
    max_videos_per_message: int | None = None,
    video_sampling: Any = None,
) -> DataSurvey:
    """Read every record of ``paths`` (relative ones: to ``base_dir``, the config's folder) with ``section``'s
    format, keys and image settings, decoding every image and video (sampled as the run would, ``video_sampling``
    being the family's default); return the counts and every problem found."""
    survey = DataSurvey()
    base = Path(base_dir)
    parse = datasets._parse_messages_record if section.format == "messages" else datasets._parse_placeholder_record
    try:
        extra_roots = image_roots(section, base)
    except DataError as exc:
        survey.problems.append(str(exc))
        extra_roots = ()
    for shown in paths:
        try:
            path = data_path(shown, base)
        except DataError as exc:
            survey.problems.append(str(exc))
            continue
        survey.files += 1
        roots = (path.parent.resolve(), *extra_roots)
        limits = ImageLimits.from_section(section, base_dir=path.parent, roots=roots)
        video_limits, sampling = (
            VideoLimits.from_section(section, limits),
            datasets.run_video_sampling(section, video_sampling),
        )
        for record_id, record in _records(path, shown, survey):
            if num_samples is not None and survey.examples >= num_samples:
                break
            survey.records += 1
            try:
                draft = parse(record, record_id, section)
            except (DataError, RecursionError, OSError) as exc:
                survey.problems.append(
                    str(exc) if isinstance(exc, DataError) else f"{record_id}: {type(exc).__name__}: {exc}"
                )
                continue
            bad = []
            for source, field in draft.sources:
                try:
                    decode_image(source, limits=limits, where=f"{record_id} {field}")
                    survey.images += 1
                except ImageError as exc:
                    bad.append(exc)
                except OSError as exc:  # e.g. a path that is a folder: the run would stop here too
                    bad.append(
                        ImageError(f"{record_id} {field}", f"cannot read the image ({type(exc).__name__}: {exc})")
                    )
            for source, field, own in draft.videos:
                try:
                    decode_video(source, limits=video_limits, sampling=own.over(sampling), where=f"{record_id} {field}")
                except ImageError as exc:
                    bad.append(exc)
            if any(section.on_bad_image == "error" or isinstance(exc, ImagePathError) for exc in bad):
                survey.problems.extend(str(exc) for exc in bad)
                continue
            if bad:
                survey.skipped.extend(f'{exc} (skipped: on_bad_image = "skip")' for exc in bad)
                continue
            if max_images_per_message is not None:
                too_many = _images_per_message(draft, max_images_per_message, family)
                if max_videos_per_message is not None:
                    too_many += _images_per_message(draft, max_videos_per_message, family, kind="video")
                survey.problems.extend(too_many)
                if too_many:
                    continue
            survey.examples += 1
    if not survey.examples and not survey.problems and survey.files:  # the run would stop: nothing to train on
        if survey.skipped:
            survey.problems.append(
                f"every record of {', '.join(paths)} was skipped for a bad image ({len(survey.skipped)})"
            )
        else:
            survey.problems.append(f"no records in {', '.join(paths)}")
    return survey

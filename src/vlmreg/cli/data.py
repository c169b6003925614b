"""``vlmreg data preview CONFIG`` and ``vlmreg data tasks``: look at what a run trains on before it trains.

``preview`` loads the examples exactly as ``vlmreg train`` does (task or dataset files, same order, same
skipping) and the family's processor, but not the model, so it answers in seconds. It shows each sample's first
prompt as the environment gives it (system prompt included), with every image as its size and the number of
image tokens the processor makes of it; then what the model gets: the prompt's token ids (chat template applied)
decoded, unknown tokens counted, and the answer as the tokenizer can write it when it cannot write it exactly. A
warning names the words that become the unknown token when more than 1% of the data's text does
(`vlmreg.data.unknown_tokens`). It can draw a contact sheet PNG to eyeball the images.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from vlmreg.cli.config_cmds import add_set_option, load_resolved
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_task_registry

#: Contact sheet geometry, in pixels.
_COLUMNS, _CELL_WIDTH, _PAD, _THUMB_HEIGHT, _GAP = 4, 360, 10, 120, 6
_PROMPT_LINES, _ANSWER_LINES, _FONT_SIZE = 9, 2, 13
#: Feature cache of the preview's image store: only token counts are kept, so a small LRU is enough.
_FEATURE_CACHE_BYTES = 64 << 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="preview a run's examples; list the registered tasks")
    data_sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    preview = data_sub.add_parser("preview", help="show the first examples of a run, with image sizes and image tokens")
    preview.add_argument("config", help="a run config (TOML)")
    preview.add_argument("--n", type=_positive_int, default=4, help="how many samples to show (default 4)")
    preview.add_argument("--out", type=Path, metavar="FILE.png", help="also draw the samples as a contact sheet PNG")
    add_set_option(preview)
    preview.add_argument("--json", action="store_true", help="print JSON for machines")
    preview.set_defaults(run=run_preview)
    tasks = data_sub.add_parser("tasks", help="list the registered tasks and the distributions that registered them")
    tasks.add_argument("--json", action="store_true", help="print JSON for machines")
    tasks.set_defaults(run=run_tasks)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {text!r})")
    return value


# -- preview: what the run reads --------------------------------------------------------------------------
def image_marker(image: dict[str, Any]) -> str:
    """How an image reads inside a message's text: ``[image 64x64, 4 tokens]`` (a video: ``[video 4 frames 64x64, 22
    tokens]``)."""
    if "frames" in image:
        return f"[video {image['frames']} frames {image['width']}x{image['height']}, {image['tokens']} tokens]"
    return f"[image {image['width']}x{image['height']}, {image['tokens']} tokens]"


def message_text(content: Any, images: dict[str, dict[str, Any]]) -> str:
    """A message's content as one string, each image part replaced by its marker, spaced as words are."""
    if isinstance(content, str):
        return content
    text, after_image = "", False
    for part in content:
        is_image = part.get("type") in ("image", "video")
        piece = image_marker(images[part[part["type"]]]) if is_image else str(part.get("text", ""))
        if (
            text
            and piece
            and (
                (is_image and not (text[-1].isspace() or text[-1] in "([{'\""))
                or (after_image and not (piece[0].isspace() or piece[0] in ".,;:!?)]}'\""))
            )
        ):
            text += " "
        text, after_image = text + piece, is_image
    return text


def build_preview(config: str, sets: list[str], n: int) -> tuple[dict[str, Any], Any]:
    """The preview record (what ``--json`` prints) and the image store holding the samples' images."""
    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.prompts import PromptEncoder  # noqa: PLC0415

    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.store import ImageStore  # noqa: PLC0415
    from vlmreg.data.unknown_tokens import survey_unknown_tokens, unknown_token_id  # noqa: PLC0415

    # deferred: start-up cost (loads asyncio, concurrent)
    from vlmreg.envs.calls import first_messages  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, torch)
    from vlmreg.loading.load import load_processor  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, urllib.request)
    from vlmreg.train.source import load_run_data  # noqa: PLC0415

    rc = load_resolved(config, sets)
    processor = load_processor(rc)
    store = ImageStore(max_feature_bytes=_FEATURE_CACHE_BYTES)
    data = load_run_data(rc, store, base_dir=Path(config).resolve().parent)
    encoder = PromptEncoder(processor, store, rc.family)
    images: dict[str, dict[str, Any]] = {}
    image_tokens = 0
    for example in data.examples:
        for image_id in example.image_ids():
            if image_id not in images:
                width, height = store.get(image_id).size
                images[image_id] = {
                    "id": image_id,
                    "width": width,
                    "height": height,
                    "tokens": encoder.image(image_id).tokens,
                }
            image_tokens += images[image_id]["tokens"]
        # shown as a marker; its tokens (timestamps included) count as image tokens
        for video_id in example.video_ids():
            if video_id not in images:
                video = store.video(video_id)
                width, height = store.get(video.frame_ids[0]).size
                images[video_id] = {
                    "id": video_id,
                    "width": width,
                    "height": height,
                    "frames": len(video.frame_ids),
                    "tokens": encoder.image(video_id).tokens,
                }
            image_tokens += images[video_id]["tokens"]
    samples = []
    unk = unknown_token_id(encoder.tokenizer)
    for example in data.examples[:n]:
        messages = first_messages(data.make_env(example), example)
        rendered = []
        for message in messages:
            parts = [] if isinstance(message["content"], str) else message["content"]
            ids = [part["image"] for part in parts if part.get("type") == "image"]
            rendered.append(
                {
                    "role": message["role"],
                    "text": message_text(message["content"], images),
                    "images": [images[i] for i in ids],
                }
            )
        prompt = encoder.encode(messages, template_kwargs=rc.chat_template_kwargs, where=example.id)
        answer_ids = (
            encoder.tokenizer(example.answer, add_special_tokens=False)["input_ids"]
            if isinstance(example.answer, str)
            else []
        )
        samples.append(
            {
                "id": example.id,
                "task": example.task,
                "messages": rendered,
                "model_text": model_text(encoder.tokenizer, prompt, images),
                "prompt_tokens": len(prompt.input_ids),
                "unknown_tokens": sum(1 for token in prompt.input_ids if token == unk) if unk is not None else 0,
                "answer": example.answer,
                "answer_model_text": encoder.tokenizer.decode(answer_ids) if answer_ids else None,
                "answer_unknown_tokens": sum(1 for token in answer_ids if token == unk) if unk is not None else 0,
                "image_tokens": sum(image["tokens"] for m in rendered for image in m["images"]),
            }
        )
    unknown = survey_unknown_tokens(encoder.tokenizer, data.examples)
    record = {
        "config": config,
        "family": rc.family.name,
        "source": data.description,
        "examples": len(data.examples),
        "skipped": data.skipped,
        "unique_images": len(images),
        "image_tokens": image_tokens,
        "unknown_tokens": None
        if unknown is None
        else {
            "token": unknown.unknown_token,
            "examples": unknown.examples,
            "tokens": unknown.tokens,
            "unknown": unknown.unknown,
            "share": unknown.share,
            "words": dict(unknown.words),
            "answers": list(unknown.answers),
        },
        "warning": unknown.describe(rc.family.name) if unknown is not None and unknown.too_many else None,
        "samples": samples,
    }
    return record, store


def model_text(tokenizer: Any, prompt: Any, images: dict[str, dict[str, Any]]) -> str:
    """The prompt as the model gets it: its token ids decoded (chat template, special and unknown tokens shown), each
    image's span of tokens as its marker."""
    pieces, at = [], 0
    for image_id, (start, end) in zip(prompt.image_ids, prompt.image_spans, strict=True):
        pieces += [tokenizer.decode(prompt.input_ids[at:start]), image_marker(images[image_id])]
        at = end
    pieces.append(tokenizer.decode(prompt.input_ids[at:]))
    return "".join(pieces)


def answer_text(answer: Any) -> str:
    return answer if isinstance(answer, str) else json.dumps(answer, default=str)


def totals_line(record: dict[str, Any]) -> str:
    return (
        f"{record['examples']} examples, {record['skipped']} skipped records, {record['unique_images']} unique images, "
        f"{record['image_tokens']} image tokens ({record['family']} processor)"
    )


def run_preview(args: argparse.Namespace) -> int:
    if args.out is not None and args.out.suffix.lower() != ".png":
        raise VlmregError(f"--out {args.out}: the contact sheet is a PNG; name the file *.png")
    record, store = build_preview(args.config, args.sets, args.n)
    if args.out is not None:
        write_contact_sheet(record, store, args.out)
        record["contact_sheet"] = str(args.out)
    if args.json:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import print_json  # noqa: PLC0415

        print_json(record)
        return 0
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    for sample in record["samples"]:
        task = f"  [dim](task {escape(sample['task'])})[/]" if sample["task"] else ""
        stdout.print(f"[bold]{escape(sample['id'])}[/]{task}", soft_wrap=True)
        for message in sample["messages"]:
            stdout.print(f"  [cyan]{escape(message['role']):<9}[/] {escape(message['text'])}", soft_wrap=True)
        unknown = f"  [red]({sample['unknown_tokens']} unknown)[/]" if sample["unknown_tokens"] else ""
        stdout.print(f"  [magenta]{'tokens':<9}[/] {escape(repr(sample['model_text']))}{unknown}", soft_wrap=True)
        written = (
            f"  [red](the model writes it as {escape(repr(sample['answer_model_text']))})[/]"
            if sample["answer_unknown_tokens"]
            else ""
        )
        stdout.print(f"  [green]{'answer':<9}[/] {escape(answer_text(sample['answer']))}{written}", soft_wrap=True)
    stdout.print(f"[dim]{escape(record['source'])}[/]", soft_wrap=True)
    stdout.print(totals_line(record), soft_wrap=True)
    if record["warning"]:
        stdout.print(f"[yellow]warning:[/] {escape(record['warning'])}", soft_wrap=True)
    if args.out is not None:
        stdout.print(f"contact sheet: {escape(str(args.out))}", soft_wrap=True)
    return 0


# -- preview: the contact sheet ---------------------------------------------------------------------------
def _font(size: int) -> Any:
    # deferred: start-up cost (loads PIL)
    from PIL import ImageFont  # noqa: PLC0415

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the bitmap font, one size
        return ImageFont.load_default()


def wrap(text: str, font: Any, width: int) -> list[str]:
    """Lines of ``text`` no wider than ``width`` pixels: words wrapped, words too long for a line cut."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if font.getlength(candidate) <= width:
                line = candidate
                continue
            if line:
                lines.append(line)
            line = ""
            for char in word:
                if line and font.getlength(line + char) > width:
                    lines.append(line)
                    line = ""
                line += char
        lines.append(line)
    return lines


def clip(lines: list[str], most: int, font: Any, width: int) -> list[str]:
    """At most ``most`` lines; when text is cut (or the last line is too wide), the last kept line ends in ``...``."""
    kept = lines[:most]
    if len(lines) <= most and font.getlength(kept[-1]) <= width:
        return kept
    last = kept[-1]
    while last and font.getlength(last + "...") > width:
        last = last[:-1]
    kept[-1] = last + "..."
    return kept


def _thumbnails(image_ids: list[str], store: Any, width: int, height: int) -> list[Any]:
    """Every image of a sample scaled (up or down) to share one row ``width`` wide and ``height`` high."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    if not image_ids:
        return []
    box = max(1, (width - _GAP * (len(image_ids) - 1)) // len(image_ids))
    thumbs = []
    for image_id in image_ids:
        image = store.get(image_id)
        scale = min(box / image.width, height / image.height)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        thumbs.append(image.resize(size, Image.Resampling.NEAREST if scale > 1 else Image.Resampling.LANCZOS))
    return thumbs


def write_contact_sheet(record: dict[str, Any], store: Any, path: Path) -> None:
    """Draw one cell per sample (its images, prompt and answer) under a title line, and save it as PNG."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image, ImageDraw  # noqa: PLC0415

    font, title_font = _font(_FONT_SIZE), _font(_FONT_SIZE + 2)
    line = font.getbbox("Hg")[3] + 4
    samples = record["samples"]
    text_width = _CELL_WIDTH - 2 * _PAD
    prompts = [
        clip(
            [wrapped for m in s["messages"] for wrapped in wrap(f"{m['role']}: {m['text']}", font, text_width)],
            _PROMPT_LINES,
            font,
            text_width,
        )
        for s in samples
    ]
    answers = [
        clip(wrap(f"answer: {answer_text(s['answer'])}", font, text_width), _ANSWER_LINES, font, text_width)
        for s in samples
    ]
    text_lines = max((len(p) + len(a) for p, a in zip(prompts, answers, strict=True)), default=1)
    thumb_height = _THUMB_HEIGHT + _GAP if any(m["images"] for s in samples for m in s["messages"]) else 0
    columns = max(1, min(_COLUMNS, len(samples)))
    rows = math.ceil(len(samples) / columns)
    cell_height = _PAD + line + thumb_height + text_lines * line + _PAD
    title_height = _PAD + 2 * (line + 2) + _PAD
    sheet = Image.new("RGB", (columns * _CELL_WIDTH, title_height + rows * cell_height), "white")
    draw = ImageDraw.Draw(sheet)
    title_width = sheet.width - 2 * _PAD
    title = clip(
        wrap(f"{record['config']}: family {record['family']}, {record['source']}", title_font, title_width),
        1,
        title_font,
        title_width,
    )
    draw.text((_PAD, _PAD), title[0], fill="black", font=title_font)
    draw.text(
        (_PAD, _PAD + line + 2),
        clip(wrap(totals_line(record), font, title_width), 1, font, title_width)[0],
        fill=(90, 90, 90),
        font=font,
    )
    for index, sample in enumerate(samples):
        left = (index % columns) * _CELL_WIDTH
        top = title_height + (index // columns) * cell_height
        draw.rectangle((left, top, left + _CELL_WIDTH - 1, top + cell_height - 1), outline=(200, 200, 200))
        x, y = left + _PAD, top + _PAD
        draw.text((x, y), clip(wrap(sample["id"], font, text_width), 1, font, text_width)[0], fill="black", font=font)
        y += line
        for thumb in _thumbnails(
            [i["id"] for m in sample["messages"] for i in m["images"]], store, text_width, _THUMB_HEIGHT
        ):
            sheet.paste(thumb, (x, y + (_THUMB_HEIGHT - thumb.height) // 2))
            x += thumb.width + _GAP
        x, y = left + _PAD, y + thumb_height
        for text, colour in [(t, (40, 40, 40)) for t in prompts[index]] + [(t, (0, 110, 0)) for t in answers[index]]:
            draw.text((x, y), text, fill=colour, font=font)
            y += line
    try:
        sheet.save(path, format="PNG")
    except OSError as exc:
        raise VlmregError(f"--out {path}: cannot write the contact sheet ({exc.strerror or exc})") from None


# -- tasks --------------------------------------------------------------------------------------------------
def task_records() -> list[dict[str, Any]]:
    """Every registered task: what it asks, how it is scored, and the distribution that registered it."""

    # deferred: `vlmreg` starts without it (functools, logging, string, ...)
    from vlmreg.rewards.registry import reward_names, unknown_reward_message  # noqa: PLC0415

    registry = get_task_registry()
    known = set(reward_names())
    problems = [
        f"task {name!r} from {registry.plugin_of(name).origin} uses "
        + "; ".join(unknown_reward_message(reward) for reward in registry.get(name).reward if reward not in known)
        for name in registry.names()
        if any(reward not in known for reward in registry.get(name).reward)
    ]
    if problems:  # never list a task whose own reward no run could compute
        raise VlmregError(" | ".join(problems))
    records = []
    for name in registry.names():
        task, plugin = registry.get(name), registry.plugin_of(name)
        records.append(
            {
                "name": task.name,
                "description": task.description,
                "reward": dict(task.reward),
                "choices": list(task.choices) if task.choices is not None else None,
                "system_prompt": task.system_prompt,
                "multi_turn": task.environment is not None,
                "plugin": plugin.distribution or plugin.name,
                "plugin_version": plugin.version,
                "entry_point": plugin.entry_point,
            }
        )
    return records


def run_tasks(args: argparse.Namespace) -> int:
    records = task_records()
    if args.json:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import print_json  # noqa: PLC0415

        print_json(records)
        return 0
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    for r in records:
        reward = ", ".join(f"{name} {weight:g}" for name, weight in r["reward"].items())
        stdout.print(
            f"[bold]{escape(r['name'])}[/]  [dim]from {escape(r['plugin'])} {escape(r['plugin_version'] or '')}[/]\n"
            f"  {escape(r['description'] or '(no description)')}\n"
            f"  reward      {escape(reward)}\n"
            f"  choices     {escape(', '.join(r['choices'])) if r['choices'] else '-'}\n"
            f"  turns       {'several (environment)' if r['multi_turn'] else 'one'}",
            soft_wrap=True,
        )
    usage = escape('[data] task = "NAME"')
    stdout.print(
        f"[dim]{len(records)} tasks. Use one with {usage}; `vlmreg data preview CONFIG` shows its examples.[/]",
        soft_wrap=True,
    )
    return 0

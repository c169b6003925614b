"""Video records: real MP4 files written by FFmpeg (PyAV), data: URIs, HTTP and frame lists, sampled as the options say,
frames stored once, and every limit and damage an error naming the record and the key."""

from __future__ import annotations

import base64
import io
import json
import re
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from PIL import Image

from tests.data.samples import png_bytes
from tests.http_stub import StubServer, send
from vlmreg.cli import main
from vlmreg.config.schema import DataSection
from vlmreg.data import ImageError, ImageStore, load_examples
from vlmreg.data.datasets import DataError
from vlmreg.data.video import DecodedVideo, VideoLimits, decode_video, sample_indices
from vlmreg.sdk.video import VideoSampling

#: Frame k of the test clips is a flat grey of level 20 k: its colour says which frame it is, through H.264's loss.
LEVEL = 20


def mp4_bytes(frames: int = 8, fps: int = 4, size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(
                np.full((size[1], size[0], 3), (LEVEL * k) % 256, np.uint8), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def frame_number(image: Any) -> int:
    return round(image.convert("L").getpixel((image.width // 2, image.height // 2)) / LEVEL)


def write(base: Path, records: list[Any]) -> None:
    (base / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def record(video: Any, **options: Any) -> dict[str, Any]:
    part = {"type": "video", "video": video, **options}
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "which first?"}]}], "answer": "x"}


def load(base: Path, sampling: VideoSampling | None = None, **fields: Any) -> tuple[Any, ImageStore]:
    store = ImageStore()
    return load_examples(DataSection(paths=["d.jsonl"], **fields), store, base_dir=base, video_sampling=sampling), store


def frames_of(store: ImageStore, example: Any) -> list[int]:
    video = store.video(example.video_ids()[0])
    return [frame_number(store.get(f)) for f in video.frame_ids]


def test_sample_indices_spread_over_the_whole_video() -> None:
    assert sample_indices(8, 4.0, VideoSampling(fps=2.0)) == (0, 2, 5, 7)  # 2 s at 2 a second: 4 frames, first to last
    assert sample_indices(8, 4.0, VideoSampling(fps=2.0, max_frames=2)) == (0, 7)
    assert sample_indices(8, 4.0, VideoSampling(fps=0.1)) == (0,)
    assert sample_indices(5, 1.0, VideoSampling(fps=30.0)) == (0, 1, 2, 3, 4)  # never more frames than there are


def test_an_mp4_file_is_decoded_sampled_and_timed(tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes())
    write(tmp_path, [record("clip.mp4")])
    loaded, store = load(tmp_path, VideoSampling(fps=2.0))
    example = loaded.examples[0]
    video = store.video(example.video_ids()[0])
    assert frames_of(store, example) == [0, 2, 5, 7]
    assert (video.fps, video.total_frames, video.frame_indices) == (4.0, 8, (0, 2, 5, 7))
    assert example.messages[0]["content"][0] == {"type": "video", "video": example.video_ids()[0]}


def test_record_options_beat_the_run_which_beats_the_family(tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes())
    write(tmp_path, [record("clip.mp4"), record("clip.mp4", max_frames=2, max_pixels=300)])
    loaded, store = load(tmp_path, VideoSampling(fps=1.0, max_pixels=10_000), video_fps=4.0)
    plain, own = loaded.examples
    assert frames_of(store, plain) == list(range(8))  # the run's 4 fps over the family's 1
    assert frames_of(store, own) == [0, 7]  # the record's max_frames
    assert store.get(store.video(plain.video_ids()[0]).frame_ids[0]).size == (64, 48)  # under the family's max_pixels
    assert store.get(store.video(own.video_ids()[0]).frame_ids[0]).size == (20, 15)  # the record's: 300 px, aspect kept


def test_a_data_uri_and_an_http_url_give_the_same_frames(tmp_path: Path) -> None:
    data = mp4_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            send(self, 200, data)

        def log_message(self, *args: Any) -> None:
            pass

    server = StubServer(Handler)
    try:
        uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
        write(
            tmp_path,
            [
                record(uri),
                {
                    **record(None),
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "video_url", "video_url": {"url": server.url + "/clip.mp4"}}],
                        }
                    ],
                },
            ],
        )
        loaded, store = load(tmp_path, VideoSampling(fps=2.0), allow_http=True)
    finally:
        server.close()
    first, second = loaded.examples
    assert first.video_ids() == second.video_ids() and frames_of(store, first) == [0, 2, 5, 7]


def test_http_is_refused_unless_allowed(tmp_path: Path) -> None:
    write(tmp_path, [record("http://127.0.0.1:9/clip.mp4")])
    with pytest.raises(
        ImageError, match=r"d.jsonl:1 messages\[0\].content\[0\].video: fetching videos over HTTP is off"
    ):
        load(tmp_path)


def test_a_list_of_frames_is_a_video_at_the_given_rate(tmp_path: Path) -> None:
    for k in range(6):
        (tmp_path / f"f{k}.png").write_bytes(png_bytes((32, 32), (LEVEL * k,) * 3))
    write(
        tmp_path,
        [record([f"f{k}.png" for k in range(6)], fps=3), record([f"f{k}.png" for k in range(6)], max_frames=3)],
    )
    loaded, store = load(tmp_path)
    full, cut = loaded.examples
    assert frames_of(store, full) == [0, 1, 2, 3, 4, 5] and store.video(full.video_ids()[0]).fps == 3.0
    assert frames_of(store, cut) == [0, 2, 5]
    assert len(store) == 6  # the second video's frames are the first's: stored once


def test_a_video_shown_in_four_turns_stores_its_sixteen_frames_once() -> None:
    store = ImageStore()
    frames = tuple(Image.new("RGB", (16, 16), (k * 15, 0, 0)) for k in range(16))
    ids = {store.add_video(DecodedVideo(frames, 2.0, 16, tuple(range(16)))) for _ in range(4)}
    assert len(ids) == 1 and len(store) == 16 and store.video_count == 1
    store.retain(ids)
    assert len(store) == 16  # a kept video keeps its frames
    store.retain([])
    assert len(store) == 0 and store.video_count == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_video_bytes": 100}, r"video is \d+ bytes, more than max_video_bytes \(100\)"),
        ({"max_video_seconds": 1.0}, r"video is 2.0 s long, more than max_video_seconds \(1\)"),
        ({"max_image_pixels": 1000}, r"video frames are 64x48 = 3072 pixels, more than max_image_pixels \(1000\)"),
        ({"max_video_frames": 3, "video_fps": 4.0}, r"video would keep 8 frames, more than max_video_frames \(3\)"),
    ],
)
def test_each_limit_is_an_error_naming_the_record_and_the_key(
    tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes())
    write(tmp_path, [record("clip.mp4")])
    with pytest.raises(ImageError, match=r"^d.jsonl:1 messages\[0\].content\[0\].video: " + message):
        load(tmp_path, **fields)


def test_damaged_and_bad_videos_name_the_record(tmp_path: Path) -> None:
    data = mp4_bytes(frames=40)
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.mp4").write_bytes(b"not a video at all")
    for name, expected in (
        ("cut.mp4", "damaged video|not a video FFmpeg can read"),
        ("text.mp4", "not a video FFmpeg can read"),
        ("missing.mp4", "video file not found"),
    ):
        write(tmp_path, [record(name)])
        with pytest.raises(ImageError, match=rf"^d.jsonl:1 messages\[0\].content\[0\].video: ({expected})"):
            load(tmp_path, video_fps=30.0)
    write(tmp_path, [record(name := "/etc/hostname")])
    with pytest.raises(ImageError, match=rf"video path '{name}' resolves to .*outside the allowed image folders"):
        load(tmp_path)
    write(tmp_path, [record("clip.mp4", fps=-1)])
    with pytest.raises(
        DataError, match=r"d.jsonl:1 messages\[0\].content\[0\].fps: expected a positive number, got -1"
    ):
        load(tmp_path)
    write(tmp_path, [record(7)])
    with pytest.raises(DataError, match=r"d.jsonl:1 messages\[0\].content\[0\].video: expected a video"):
        load(tmp_path)


def test_a_damaged_video_is_skipped_like_a_bad_image(tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes())
    (tmp_path / "text.mp4").write_bytes(b"junk")
    write(tmp_path, [record("text.mp4"), record("clip.mp4")])
    loaded, store = load(tmp_path, on_bad_image="skip")
    assert len(loaded.examples) == 1 and loaded.skipped[0].record == "d.jsonl:1" and store.video_count == 1


def test_decode_video_takes_bytes_under_the_byte_limit() -> None:
    data = mp4_bytes()
    video = decode_video(data, limits=VideoLimits(), sampling=VideoSampling(max_frames=3), where="w")
    assert [frame_number(f) for f in video.frames] == [0, 4, 7]  # no fps: every frame, then max_frames spread
    with pytest.raises(ImageError, match="^w: video is"):
        decode_video(data, limits=VideoLimits(max_bytes=10), sampling=VideoSampling(), where="w")


def test_validate_data_decodes_every_video_and_names_a_family_without_video(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes())
    (tmp_path / "junk.mp4").write_bytes(b"junk")
    write(tmp_path, [record("clip.mp4"), record("junk.mp4")])
    for family, expected in (
        ("qwen3_vl", ["d.jsonl:2 messages[0].content[0].video: not a video FFmpeg can read"]),
        (
            "gemma3",
            [
                "d.jsonl:1: messages[0] carries a video, but family gemma3 takes no video input",
                "d.jsonl:2 messages[0].content[0].video: not a video FFmpeg can read",
            ],
        ),
    ):
        config = tmp_path / "run.toml"
        config.write_text(
            f'[model]\ninit = "random"\nfamily = "{family}"\n\n[data]\npaths = ["d.jsonl"]\n\n[reward]\nfunctions = '
            f"{{ exact_match = 1.0 }}\n"
        )
        assert main(["validate", str(config), "--data"]) == 1
        err = capsys.readouterr().err
        assert all(line in err for line in expected), err
        assert (family == "qwen3_vl") == ("carries a video" not in err)


def test_the_video_record_in_docs_data_md_loads(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    [video_record] = [json.loads(b) for b in re.findall(r"```jsonl\n(.*?)\n```", doc, re.S) if '"video"' in b]
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "turn.mp4").write_bytes(mp4_bytes(frames=40, fps=4))  # 10 s: 1 a second, then max_frames 8
    write(tmp_path, [video_record])
    loaded, store = load(tmp_path)
    video = store.video(loaded.examples[0].video_ids()[0])
    assert len(video.frame_ids) == 8 and video.frame_indices == (0, 6, 11, 17, 22, 28, 33, 39)

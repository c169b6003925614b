"""`ImageStore`: images by content hash, decoded once, turned into model inputs once, by the family's processor.

Samples hold image ids, never pixels. A multi-turn trajectory that shows an image again refers to the
same id, so it costs no new memory. Each image is given to the family's processor alone, with the
family's image placeholder as the text (`process_image`); what comes back is cached (LRU, bounded in
bytes) as `ImageFeatures`: the token ids the placeholder expands to, the token-aligned inputs over them
(any processor output shaped like ``input_ids``), and the image's tensors. A batch's image tensors are
assembled from per-image features at the last moment, by the family's ``collate_images`` (default
`pad_and_concat`).

Videos live here too (`add_video`): each sampled frame is an image of the store (so a video shown in four turns, or
two videos sharing frames, hold each distinct frame once) and the video is its frames' ids and timing, under an id
that begins ``video:``. Its features come from the processor given the whole video with the family's video
placeholder; a prompt's ``image_ids`` hold image and video ids alike, in token order.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from vlmreg.sdk.errors import VlmregError

__all__ = [
    "ImageFeatures",
    "ImageStore",
    "ImageTokenError",
    "StoredVideo",
    "VIDEO_ID_PREFIX",
    "image_id_of",
    "video_id_of",
    "pad_and_concat",
    "pad_token_id",
    "process_image",
    "token_aligned_keys",
]

# Processor outputs that describe the text as a whole, never an image.
_TEXT_KEYS = {"input_ids", "attention_mask"}
# Processor outputs that describe a video rather than feed the model (some return their sampling metadata).
_METADATA_KEYS = {"video_metadata"}
#: Processor outputs that are training targets, not model inputs (some transformers processors return ``labels``,
#: for fine-tuning): vlmreg never passes them to a forward.
TARGET_KEYS = frozenset({"labels"})

Collate = Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]]


class ImageTokenError(VlmregError):
    """Image tokens and image features disagree (a template or truncation dropped or duplicated an image)."""


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's padding id, or its end-of-text id when it has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def image_id_of(image: Any) -> str:
    """The content hash of an RGB PIL image: equal pixels and size give the same id."""
    digest = hashlib.sha256(f"{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()[:24]


#: How a video's id begins (an image's id is 24 hex digits): ids of both kinds share a prompt's ``image_ids``.
VIDEO_ID_PREFIX = "video:"


@attrs.frozen
class StoredVideo:
    """A video in the store: the ids of its sampled frames (images in the same store, each held once however
    many videos or turns show it) and its timing (`vlmreg.data.video.DecodedVideo`)."""

    frame_ids: tuple[str, ...]
    fps: float
    total_frames: int
    frame_indices: tuple[int, ...]


def video_id_of(video: StoredVideo) -> str:
    """The content hash of a video: its frames' ids and its timing."""
    digest = hashlib.sha256(repr((video.frame_ids, float(video.fps), video.total_frames, video.frame_indices)).encode())
    return VIDEO_ID_PREFIX + digest.hexdigest()[:24]


def is_video_id(media_id: str) -> bool:
    return media_id.startswith(VIDEO_ID_PREFIX)


@attrs.frozen(eq=False)
class ImageFeatures:
    """What the family's processor makes of one image, given alone.

    ``token_ids`` is the part of the placeholder's expansion that starts and ends at an added (special)
    token: it stands in a prompt exactly as here. ``text_before`` / ``text_after`` are plain text the
    expansion adds around it (a blank line, say); they are tokenized together with the neighbouring text,
    as the processor does when it tokenizes a whole prompt. ``token_inputs`` are the token-aligned inputs
    over ``token_ids`` (0 over text); ``tensors`` the image's own inputs (pixels, grids, sizes, masks).
    """

    token_ids: tuple[int, ...]
    token_inputs: Mapping[str, tuple[int, ...]]
    tensors: Mapping[str, Any]
    text_before: str = ""
    text_after: str = ""

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in self.tensors.values() if hasattr(t, "element_size"))


def _added_token_ids(tokenizer: Any) -> set[int]:
    """Ids the tokenizer splits out before anything else: text never merges across them."""
    return {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}


def aligned_keys(out: Mapping[str, Any]) -> set[str]:
    """Processor outputs (other than ids and mask) shaped like ``input_ids``."""
    shape = tuple(out["input_ids"].shape)
    return {
        k
        for k, v in out.items()
        if k not in _TEXT_KEYS and k not in TARGET_KEYS and tuple(getattr(v, "shape", ())) == shape
    }


def token_aligned_keys(
    processor: Any, placeholder: str, image: Any, media: Mapping[str, Any] | None = None
) -> frozenset[str]:
    """Processor outputs that run along the tokens: shaped like ``input_ids`` for one image and for two.

    (One image alone cannot tell: an image tensor such as a (1, 3) grid may match a 3-token expansion.)
    ``media``: the processor's keyword arguments for one video instead of ``image`` (`video_inputs`).
    """
    one_kw, two_kw = (
        (media_inputs(media, 1), media_inputs(media, 2))
        if media is not None
        else ({"images": [image]}, {"images": [image, image]})
    )
    one = processor(text=[placeholder], **one_kw, add_special_tokens=False, return_tensors="pt")
    two = processor(text=[placeholder * 2], **two_kw, add_special_tokens=False, return_tensors="pt")
    return frozenset(aligned_keys(one) & aligned_keys(two))


def media_inputs(media: Mapping[str, Any], copies: int) -> dict[str, Any]:
    """A video's processor arguments (`video_inputs`) for ``copies`` copies of it: each list argument repeated."""
    return {k: list(v) * copies if isinstance(v, list) else v for k, v in media.items()}


def video_inputs(video: StoredVideo, frames: Sequence[Any]) -> dict[str, Any]:
    """The processor's keyword arguments for one video: its frames as one (T, H, W, 3) uint8 array, its metadata
    (frame rate, frame count, the frames taken: a processor may write timestamps from them) and
    ``do_sample_frames=False`` (the frames are already the sampled ones)."""
    # deferred: start-up cost (loads numpy, transformers)
    import numpy as np  # noqa: PLC0415
    from transformers.video_utils import VideoMetadata  # noqa: PLC0415

    array = np.stack([np.asarray(frame, dtype=np.uint8) for frame in frames])
    metadata = VideoMetadata(
        total_num_frames=video.total_frames,
        fps=video.fps,
        width=array.shape[2],
        height=array.shape[1],
        duration=video.total_frames / video.fps,
        frames_indices=list(video.frame_indices),
    )
    return {"videos": [array], "video_metadata": [metadata], "do_sample_frames": False}


def process_image(
    processor: Any, placeholder: str, image: Any, token_keys: frozenset[str], media: Mapping[str, Any] | None = None
) -> ImageFeatures:
    """One image (or with ``media``, one video: `video_inputs`) through the processor, with the placeholder alone as
    the text (no special tokens added)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    inputs = dict(media) if media is not None else {"images": [image]}
    out = processor(text=[placeholder], **inputs, add_special_tokens=False, return_tensors="pt")
    ids = [int(t) for t in out["input_ids"][0].tolist()]
    aligned = {k: [int(x) for x in out[k][0].tolist()] for k in token_keys if k in out}
    tensors = {
        k: v
        for k, v in out.items()
        if k not in _TEXT_KEYS and k not in TARGET_KEYS and k not in aligned and k not in _METADATA_KEYS
    }
    added = _added_token_ids(tokenizer)
    marked = [i for i, t in enumerate(ids) if t in added]
    first, last = (marked[0], marked[-1] + 1) if marked else (0, len(ids))
    for key, values in aligned.items():
        if any(values[:first]) or any(values[last:]):
            raise ImageTokenError(
                f"the processor's {key!r} marks plain-text tokens around an image's expansion; vlmreg cannot place "
                "it in a prompt (give the family an image_placeholder whose expansion starts and ends at added tokens)"
            )
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    return ImageFeatures(
        token_ids=tuple(ids[first:last]),
        token_inputs={k: tuple(v[first:last]) for k, v in aligned.items()},
        tensors=tensors,
        text_before=decode(ids[:first]) if first else "",
        text_after=decode(ids[last:]) if last < len(ids) else "",
    )


def pad_and_concat(per_image: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The default ``collate_images``: each input concatenated on dim 0, one slice (or block) per image.

    Where images' tensors differ in a later dimension (native image sizes, a varying number of tiles),
    each is zero-padded at the end of that dimension to the largest, as processors pad a batch themselves.
    """
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    keys = list(per_image[0])
    for features in per_image[1:]:
        if list(features) != keys:
            raise ValueError(f"images have different processor outputs: {keys} vs {list(features)}")
    batch: dict[str, Any] = {}
    for key in keys:
        parts = [f[key] for f in per_image]
        if not all(isinstance(p, torch.Tensor) for p in parts):
            batch[key] = [x for p in parts for x in p]
            continue
        if len(parts) == 1:  # one image: its own tensor (nothing changes it in place), not a copy
            batch[key] = parts[0]
            continue
        dims = {p.dim() for p in parts}
        if len(dims) != 1:
            raise ValueError(f"{key}: images give tensors of different ranks {sorted(dims)}")
        widest = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for p in parts:
            pad: list[int] = []
            for d in reversed(range(1, p.dim())):
                pad += [0, widest[d - 1] - p.shape[d]]
            padded.append(F.pad(p, pad) if any(pad) else p)
        batch[key] = torch.cat(padded, dim=0)
    return batch


def collate_on_device(per_image: Sequence[Mapping[str, Any]], device: Any) -> dict[str, Any]:
    """`pad_and_concat` with each image's floating-point tensors (pixels) sent to ``device`` first and joined there, the
    others (grids, sizes) joined on the host: the host copies no pixels (a pinned tensor goes without waiting; another
    is pinned first). Keys in `pad_and_concat`'s order."""
    moved = [k for k, v in per_image[0].items() if _is_float_tensor(v)]
    kept = [k for k in per_image[0] if k not in moved]

    def sent(tensor: Any) -> Any:
        return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)

    on_device = pad_and_concat([{k: sent(f[k]) for k in moved} for f in per_image]) if moved else {}
    on_host = pad_and_concat([{k: f[k] for k in kept} for f in per_image]) if kept else {}
    return {k: on_device[k] if k in on_device else on_host[k] for k in per_image[0]}


def _is_float_tensor(value: Any) -> bool:
    return hasattr(value, "is_floating_point") and value.is_floating_point()


class ImageStore:
    """Decoded images by content hash, plus an LRU cache of what the processor makes of each.

    Safe to share between threads (rollouts collected ahead of training add images while the trainer reads them).
    With ``pin_memory`` (a trainer on a GPU) each cached image's floating-point tensors are kept in pinned memory, so
    a micro-batch's pixels go to the GPU without a host copy and without waiting (`collate_on_device`).
    """

    def __init__(self, max_feature_bytes: int = 1 << 30, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._lock = threading.RLock()
        self._images: dict[str, Any] = {}
        self._videos: dict[str, StoredVideo] = {}
        self._features: OrderedDict[tuple[int, str, str], ImageFeatures] = OrderedDict()
        self._token_keys: dict[tuple[int, str], frozenset[str]] = {}
        self._feature_bytes = 0
        self.max_feature_bytes = max_feature_bytes
        self.feature_computations = 0

    # -- images ---------------------------------------------------------------------------
    def add(self, image: Any) -> str:
        """Store a PIL image (converted to RGB) and return its id; an image already held is not stored again."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        key = image_id_of(image)
        with self._lock:
            self._images.setdefault(key, image)
        return key

    def get(self, image_id: str) -> Any:
        try:
            return self._images[image_id]
        except KeyError:
            raise KeyError(f"image {image_id!r} is not in the image store") from None

    def __contains__(self, image_id: object) -> bool:
        """Whether an image of this id is held (a video's: `has_video`)."""
        return image_id in self._images

    def has_video(self, video_id: str) -> bool:
        return video_id in self._videos

    def __len__(self) -> int:
        """How many images are held (a video's frames among them, each once)."""
        return len(self._images)

    # -- videos ---------------------------------------------------------------------------
    def add_video(self, video: Any) -> str:
        """Store a decoded video (`vlmreg.data.video.DecodedVideo`): each frame as an image (a frame already held,
        by this or another video, is not stored again) and the video as its frames' ids and timing; return its id."""
        stored = StoredVideo(
            tuple(self.add(frame) for frame in video.frames),
            float(video.fps),
            int(video.total_frames),
            tuple(int(i) for i in video.frame_indices),
        )
        key = video_id_of(stored)
        with self._lock:
            self._videos.setdefault(key, stored)
        return key

    def video(self, video_id: str) -> StoredVideo:
        try:
            return self._videos[video_id]
        except KeyError:
            raise KeyError(f"video {video_id!r} is not in the image store") from None

    @property
    def video_count(self) -> int:
        return len(self._videos)

    @property
    def image_bytes(self) -> int:
        """Bytes held by decoded images (RGB, 3 bytes a pixel)."""
        with self._lock:
            return sum(3 * im.width * im.height for im in self._images.values())

    @property
    def feature_bytes(self) -> int:
        """Bytes held by cached image tensors."""
        return self._feature_bytes

    # -- features -------------------------------------------------------------------------
    def features(self, image_id: str, processor: Any, placeholder: str) -> ImageFeatures:
        """The processor's features for one image, computed once and cached."""
        with self._lock:
            return self._features_locked(image_id, processor, placeholder)

    def _features_locked(self, image_id: str, processor: Any, placeholder: str) -> ImageFeatures:
        key = (id(processor), placeholder, image_id)
        cached = self._features.get(key)
        if cached is not None:
            self._features.move_to_end(key)
            return cached
        if is_video_id(image_id):
            video = self.video(image_id)
            image, media = None, video_inputs(video, [self.get(f) for f in video.frame_ids])
        else:
            image, media = self.get(image_id), None
        token_keys = self._token_keys.get(key[:2])
        if token_keys is None:
            token_keys = self._token_keys[key[:2]] = token_aligned_keys(processor, placeholder, image, media)
        features = process_image(processor, placeholder, image, token_keys, media)
        if self.pin_memory:  # in place of the pageable tensors: no more memory
            pinned = {k: v.pin_memory() if _is_float_tensor(v) else v for k, v in features.tensors.items()}
            features = attrs.evolve(features, tensors=pinned)
        self.feature_computations += 1
        self._features[key] = features
        self._feature_bytes += features.nbytes
        while self._feature_bytes > self.max_feature_bytes and len(self._features) > 1:
            _, old = self._features.popitem(last=False)
            self._feature_bytes -= old.nbytes
        return features

    def retain(self, image_ids: Iterable[str]) -> None:
        """Drop every image and video (and its features) not in ``image_ids``: those of finished trajectories. A kept
        video keeps its frames."""
        keep = set(image_ids)
        with self._lock:
            self._retain(keep)

    def _retain(self, keep: set[str]) -> None:
        for key in [k for k in self._videos if k not in keep]:
            del self._videos[key]
        keep = keep | {frame for video in self._videos.values() for frame in video.frame_ids}
        for key in [k for k in self._images if k not in keep]:
            del self._images[key]
        for feature_key in [k for k in self._features if k[2] not in keep]:
            self._feature_bytes -= self._features.pop(feature_key).nbytes

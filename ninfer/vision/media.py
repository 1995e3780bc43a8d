"""Media bytes in, RGB uint8 pixels out: sources, decoding, limits and errors.

Sources: a local path (or ``file://`` URL), an ``http(s)://`` URL (fetched under the media policy
of :mod:`ninfer.vision.fetch`: public addresses only unless allowed), a ``data:`` URI (base64 or
percent-encoded), raw ``bytes``, or a ``PIL.Image`` (Python API only). Images decode through PIL
(EXIF orientation applied, transparency composited onto white, as transformers' processor does);
videos through PyAV, decoding only up to the last sampled frame.

Every failure a client can cause is a :class:`MediaError` (a ``ValueError``) whose message says
what was wrong; exceeding a configured bound is a :class:`MediaLimitError` whose ``limit`` names
the :class:`VisionLimits` field, so a server can answer 400 with it.
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ninfer.vision.fetch import fetch

MediaKind = Literal["image", "video"]


class MediaError(ValueError):
    """Media a request cannot use (unreadable, undecodable, unsupported); the message says why."""

    limit: str | None = None


class MediaLimitError(MediaError):
    """Media over a configured bound; ``limit`` is the :class:`VisionLimits` field that was exceeded."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{message} (limit {limit})")
        self.limit = limit


class MediaFetchError(MediaError):
    """An http(s) URL that was not fetched. One message for every cause (refused by the media policy,
    closed, unreachable, timed out, an HTTP error): telling them apart would let a client probe what
    answers behind an address. The server log has the reason."""

    def __init__(self, kind: str, url: str) -> None:
        super().__init__(f"the {kind} URL {url!r} was not fetched: it was refused by this server's media "
                         "policy, unreachable, timed out or did not answer 200 OK; send a publicly reachable "
                         "http(s) URL or a data URI")


class FetchCancelled(MediaError):
    """The request that wanted the media went away (its client disconnected) while it was being fetched."""


class VisionDisabledError(MediaError):
    """A request carries images or videos but the model was loaded without vision."""


def error_code(err: MediaError) -> str:
    """A stable API error code: ``vision_disabled``, ``media_limit_exceeded`` or ``invalid_media``."""
    if isinstance(err, VisionDisabledError):
        return "vision_disabled"
    return "media_limit_exceeded" if err.limit else "invalid_media"


@dataclass(frozen=True)
class VisionLimits:
    """Per-item and per-request bounds; every one is checked before the expensive step it guards."""

    max_media_bytes: int = 64 << 20  # encoded size of one image or video
    max_image_pixels: int = 8192 * 8192  # source width x height, checked before decoding pixels
    max_video_frames: int = 768  # frames sampled from one video
    max_media_items: int = 32  # images + videos in one request
    max_media_tokens: int = 16384  # merged vision tokens in one request
    fetch_timeout_s: float = 15.0  # the whole fetch of one URL, redirects included (not per read)
    allow_local_files: bool = True  # servers should turn this off unless paths are trusted
    # http(s) media policy (ninfer.vision.fetch): public addresses only, unless allow_private_media.
    allow_remote_media: bool = True  # False: http(s) URLs are refused (data URIs, and paths if allowed, only)
    allow_private_media: bool = False  # also loopback / private networks (never link-local, multicast, reserved)
    media_allowed_hosts: tuple[str, ...] = ()  # non-empty: only these hosts ("*.example.com": its subdomains)
    max_redirects: int = 5  # per fetch, each target checked like the first URL
    media_workers: int = 4  # server threads fetching, decoding and preprocessing media (own pool)

    def __post_init__(self) -> None:
        if isinstance(self.media_allowed_hosts, str):  # a lone string would be split into characters
            object.__setattr__(self, "media_allowed_hosts", (self.media_allowed_hosts,))
        else:
            object.__setattr__(self, "media_allowed_hosts", tuple(self.media_allowed_hosts))


@dataclass(frozen=True)
class MediaRef:
    """One image or video of a prompt, in prompt order, with where its bytes come from."""

    kind: MediaKind
    source: Any  # str (path / URL / data URI), bytes, or PIL.Image.Image


def check_size(n: int, limits: VisionLimits, what: str) -> None:
    """Raise ``MediaLimitError("max_media_bytes")`` when ``n`` encoded bytes are too many."""
    if n > limits.max_media_bytes:
        raise MediaLimitError("max_media_bytes", f"{what} is {n} bytes, more than {limits.max_media_bytes}")


def _data_uri(uri: str, kind: MediaKind, limits: VisionLimits) -> bytes:
    header, sep, payload = uri[len("data:"):].partition(",")
    if not sep:
        raise MediaError("malformed data URI: no ',' separates the media type from the data")
    mime = header.split(";")[0].strip().lower()
    if mime and mime != "application/octet-stream" and not mime.startswith(f"{kind}/"):
        raise MediaError(f"unsupported media type {mime!r} for a {kind} part (expected {kind}/*)")
    if ";base64" not in header.lower():
        data = urllib.parse.unquote_to_bytes(payload)
        check_size(len(data), limits, f"the {kind} data URI")
        return data
    payload = "".join(payload.split())
    check_size(len(payload) * 3 // 4, limits, f"the {kind} data URI")  # before decoding, not after
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise MediaError(f"the {kind} data URI is not valid base64 ({err})") from None


def read_source(source: Any, kind: MediaKind, limits: VisionLimits) -> bytes:
    """The encoded bytes of a source (not for PIL images, which are already decoded)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        check_size(len(source), limits, f"the {kind}")
        return bytes(source)
    if not isinstance(source, (str, Path)):
        raise MediaError(f"unsupported {kind} source of type {type(source).__name__}; expected a URL, "
                         "data URI or path")
    text = str(source).strip()
    if text.startswith("data:"):
        return _data_uri(text, kind, limits)
    scheme = urllib.parse.urlparse(text).scheme.lower()
    if scheme in ("http", "https"):
        return fetch(text, kind, limits)
    if scheme not in ("", "file") and not (len(scheme) == 1 and text[1:3] in (":\\", ":/")):  # C:\ paths
        raise MediaError(f"unsupported {kind} URL scheme {scheme!r}: use http(s)://, data: or a local path")
    if not limits.allow_local_files:
        raise MediaError(f"local {kind} paths are not allowed here; send an http(s) URL or a data URI")
    path = Path(urllib.parse.unquote(urllib.parse.urlparse(text).path) if scheme == "file" else text).expanduser()
    if not path.is_file():
        raise MediaError(f"{kind} file not found: {path}")
    check_size(path.stat().st_size, limits, f"the {kind} file {path}")
    return path.read_bytes()


def pil_to_rgb_tensor(image: Any) -> torch.Tensor:
    """``[3, H, W]`` uint8: alpha (or a transparency key) is composited onto white, like transformers."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).contiguous()


def decode_image(source: Any, limits: VisionLimits) -> torch.Tensor:
    """Decode one image source to ``[3, H, W]`` uint8 RGB, upright (EXIF orientation applied)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        data = read_source(source, "image", limits)
        try:
            with warnings.catch_warnings():  # our own pixel limit replaces PIL's bomb warning
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            raise MediaLimitError("max_image_pixels", f"the image is too large to decode ({err})") from None
        except (UnidentifiedImageError, OSError) as err:
            raise MediaError(f"cannot decode the image: not a readable image file ({err})") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise MediaLimitError("max_image_pixels", f"the image is {width}x{height} = {width * height} pixels, "
                                                  f"more than {limits.max_image_pixels}")
    if width < 1 or height < 1:
        raise MediaError(f"the image is empty ({width}x{height})")
    try:
        image.load()  # pixel data is read lazily: truncated files fail here, not at open()
        return pil_to_rgb_tensor(ImageOps.exif_transpose(image))
    except (OSError, ValueError, SyntaxError) as err:
        raise MediaError(f"cannot decode the image: the file is truncated or corrupt ({err})") from None


@dataclass(frozen=True)
class VideoClip:
    """Sampled frames ``[T, 3, H, W]`` uint8 with the source frame index and rate they came from."""

    frames: torch.Tensor
    indices: list[int]
    fps: float


SampleFn = Callable[[int, float], np.ndarray]  # (total frames, fps) -> frame indices to keep


def decode_video(source: Any, sample: SampleFn, limits: VisionLimits) -> VideoClip:
    """Decode the sampled frames of one video with PyAV (frames are counted by demuxing if the header lacks them)."""
    try:
        import av
    except ImportError:
        raise MediaError("video input needs PyAV: pip install av") from None
    data = read_source(source, "video", limits)
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("the video has no video stream")
            stream = container.streams.video[0]
            # fps unknown: transformers assumes 24, and so do we.
            fps = float(stream.average_rate) if stream.average_rate else 24.0
            total = int(stream.frames)
            if total <= 0:
                total = sum(1 for packet in container.demux(stream) if packet.size)
                container.seek(0)
            if total <= 0:
                raise MediaError("the video has no frames")
            indices = [int(i) for i in sample(total, fps)]
            if len(indices) > limits.max_video_frames:
                raise MediaLimitError("max_video_frames", f"the video needs {len(indices)} sampled frames, "
                                                          f"more than {limits.max_video_frames}")
            wanted, last, frames = set(indices), max(indices), []
            for i, frame in enumerate(container.decode(stream)):
                if i > last:
                    break
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except MediaError:
        raise
    # PyAV raises its FFmpeg error family; broken containers also surface as ValueError/IndexError/OSError.
    except (av.FFmpegError, ValueError, IndexError, OSError, RuntimeError) as err:
        raise MediaError(f"cannot decode the video: {type(err).__name__}: {err}") from None
    if not frames:
        raise MediaError("cannot decode the video: no frame could be decoded")
    # A header that over-counts frames leaves some indices undecoded: keep those that exist.
    indices = indices[:len(frames)]
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    return VideoClip(frames=video, indices=indices, fps=fps)

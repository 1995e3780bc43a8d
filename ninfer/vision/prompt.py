"""Multimodal prompts: media parts of chat messages, placeholder expansion and 3-axis M-RoPE positions.

The chat template emits one ``<|vision_start|><|image_pad|><|vision_end|>`` per image and one
``<|vision_start|><|video_pad|><|vision_end|>`` per video (reference §11.2). Here, in token ids:

* an image pad becomes ``t*h*w / merge**2`` pads (one per merged vision token);
* a video becomes, per temporal patch, ``<{t:.1f} seconds><|vision_start|>`` + pads +
  ``<|vision_end|>``. Layout ``"qwen"`` (default) replaces the template's whole
  start/pad/end triple, as Qwen's own processor, vLLM and SGLang do; layout ``"transformers"``
  keeps the outer pair, which is what transformers' generic replacement produced up to 5.24 (5.25
  replaces the triple too).

Positions follow transformers' ``get_rope_index`` (reference §11.4): text runs count up on all
three axes; a vision run (one image or one video frame, merged grid ``h' x w'``) gets
``T = cur``, ``H = cur + row``, ``W = cur + col``; then ``cur += max(h', w')``. Tokens after the
prompt use ``position + rope_delta`` on all axes, ``rope_delta = max(position) + 1 - len(prompt)``.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ninfer.vision.media import MediaError, MediaRef

TEXT, IMAGE, VIDEO = 0, 1, 2
VideoLayout = Literal["qwen", "transformers"]


@dataclass(frozen=True)
class VisionTokens:
    image: int
    video: int
    vision_start: int
    vision_end: int

    @classmethod
    def from_ids(cls, ids: dict[str, int], token_id: Callable[[str], int | None]) -> VisionTokens:
        """From config.json's ``*_token_id`` keys, else the tokenizer's special tokens."""
        names = {"image": ("image_token_id", "<|image_pad|>"), "video": ("video_token_id", "<|video_pad|>"),
                 "vision_start": ("vision_start_token_id", "<|vision_start|>"),
                 "vision_end": ("vision_end_token_id", "<|vision_end|>")}
        values = {}
        for field_name, (key, token) in names.items():
            value = ids.get(key, token_id(token))
            if value is None:
                raise ValueError(f"the tokenizer has no {token} token and config.json no {key}: vision is unavailable")
            values[field_name] = int(value)
        return cls(**values)


@dataclass
class PreparedMedia:
    """One preprocessed image or video: flat patches, grid, and (video) a timestamp per temporal patch."""

    kind: Literal["image", "video"]
    pixels: torch.Tensor  # [t*h*w, C*T*P*P] fp32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    key: str  # content hash: identical media share cached work
    timestamps: tuple[float, ...] = ()

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


@dataclass
class MultimodalPrompt:
    """Everything a prefill needs besides the weights; ``positions`` continue with ``rope_delta``."""

    input_ids: list[int]
    mm_types: list[int]  # per token: 0 text, 1 image, 2 video
    positions: torch.Tensor  # [3, N] int64
    rope_delta: int
    media: list[PreparedMedia]  # prompt order
    media_index: torch.Tensor  # [N] int64: row in the media embeddings (prompt order), -1 for text

    @property
    def num_media_tokens(self) -> int:
        return int((self.media_index >= 0).sum())

    def decode_position(self, index: int) -> int:
        """Position (all three axes) of the token at sequence index ``index >= len(prompt)``."""
        return index + self.rope_delta


# ---------------------------------------------------------------------------- message parts

def _url(value: Any) -> Any:
    return value.get("url") if isinstance(value, dict) else value


def media_ref(part: Any) -> MediaRef | None:
    """The media of one content part (OpenAI chat/Responses, Anthropic or transformers style), else None.

    The tests mirror the chat template's, image before video, so refs come out in placeholder order.
    """
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind in ("image", "image_url", "input_image") or "image" in part or "image_url" in part:
        kind = "image"
    elif kind in ("video", "video_url", "input_video") or "video" in part or "video_url" in part:
        kind = "video"
    else:
        return None
    source = _url(part.get(f"{kind}_url")) or part.get(kind)
    block = part.get("source")  # Anthropic: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
    if source is None and isinstance(block, dict):
        if block.get("type") == "base64":
            source = f"data:{block.get('media_type', '')};base64,{block.get('data', '')}"
        else:
            source = block.get("url")
    if source is None or source == "":
        raise MediaError(f"a {kind} part has no source: give {kind}_url (a URL, data URI or path)")
    return MediaRef(kind, source)


def collect_media(messages: Sequence[dict[str, Any]]) -> list[MediaRef]:
    """Every image and video of a conversation, in the order the chat template renders them."""
    refs = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            refs.extend(r for r in map(media_ref, content) if r is not None)
    return refs


def has_media(messages: Sequence[dict[str, Any]]) -> bool:
    return bool(collect_media(messages))


def canonical_part(part: Any) -> dict[str, Any] | None:
    """A media part in the one shape the template and :func:`collect_media` both read, else None.

    Servers convert protocol-specific parts (``input_image``, Anthropic ``source`` blocks) with this
    before building template messages.
    """
    ref = media_ref(part)
    return None if ref is None else {"type": ref.kind, ref.kind: ref.source}


def rebase_local_paths(messages: Sequence[dict[str, Any]], base: Path) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose relative media paths are resolved against ``base`` (a messages file's folder)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                part = canonical_part(part) or part
                src = part.get(part.get("type", "")) if isinstance(part, dict) else None
                if isinstance(src, str) and "://" not in src and not src.startswith("data:") \
                        and not Path(src).expanduser().is_absolute() and (base / src).is_file():
                    part = {**part, part["type"]: str(base / src)}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out


# ---------------------------------------------------------------------------- placeholders

def expand_placeholders(
    ids: Sequence[int], media: Sequence[PreparedMedia], tokens: VisionTokens, merge: int,
    encode: Callable[[str], list[int]], video_layout: VideoLayout = "qwen",
) -> tuple[list[int], list[int]]:
    """Replace each image/video pad of a rendered prompt by its expansion; returns (ids, mm_types)."""
    pads = [t for t in ids if t in (tokens.image, tokens.video)]
    if len(pads) != len(media):
        raise MediaError(f"the prompt holds {len(pads)} image/video placeholders but {len(media)} media were "
                         "given (is an <|image_pad|> or <|video_pad|> typed in the text?)")
    out: list[int] = []
    types: list[int] = []
    items = iter(media)
    skip_end = False
    for i, tok in enumerate(ids):
        if skip_end:  # the vision_end of a replaced video triple
            skip_end = False
            continue
        if tok not in (tokens.image, tokens.video):
            out.append(tok)
            types.append(TEXT)
            continue
        item = next(items)
        expected = "image" if tok == tokens.image else "video"
        if item.kind != expected:
            raise MediaError(f"placeholder order mismatch: the prompt has a {expected} where the messages "
                             f"have a {item.kind}")
        if item.kind == "image":
            n = item.num_tokens(merge)
            out += [tok] * n
            types += [IMAGE] * n
            continue
        wrapped = bool(out) and out[-1] == tokens.vision_start and i + 1 < len(ids) and ids[i + 1] == tokens.vision_end
        if video_layout == "qwen" and wrapped:
            out.pop()
            types.pop()
            skip_end = True
        per_frame = item.grid[1] * item.grid[2] // (merge * merge)
        for stamp in item.timestamps:
            text = encode(f"<{stamp:.1f} seconds>")
            out += text + [tokens.vision_start] + [tok] * per_frame + [tokens.vision_end]
            types += [TEXT] * (len(text) + 1) + [VIDEO] * per_frame + [TEXT]
    return out, types


def rope_index(mm_types: Sequence[int], media: Sequence[PreparedMedia], merge: int) -> tuple[torch.Tensor, int]:
    """``[3, N]`` positions and ``rope_delta`` for a token sequence (transformers' ``get_rope_index``)."""
    # Videos split into one (1, h, w) grid per temporal patch: frames are separate runs.
    grids = {IMAGE: iter([m.grid for m in media if m.kind == "image"]),
             VIDEO: iter([(1, m.grid[1], m.grid[2]) for m in media if m.kind == "video" for _ in range(m.grid[0])])}
    parts, cur = [], 0
    for kind, run in itertools.groupby(mm_types):
        n = len(list(run))
        if kind == TEXT:
            parts.append(torch.arange(cur, cur + n).expand(3, n))
            cur += n
            continue
        t, h, w = next(grids[kind])
        gh, gw = h // merge, w // merge
        if n != t * gh * gw:
            raise ValueError(f"a vision run of {n} tokens does not match its grid {t}x{gh}x{gw}")
        tpos = torch.full((t, gh, gw), cur)  # t == 1: every frame is its own run
        hpos = (torch.arange(gh) + cur)[None, :, None].expand(t, gh, gw)
        wpos = (torch.arange(gw) + cur)[None, None, :].expand(t, gh, gw)
        parts.append(torch.stack([tpos, hpos, wpos]).reshape(3, -1))
        cur += max(gh, gw)
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - positions.shape[1] if positions.numel() else 0
    return positions.long(), delta


def build_prompt(
    ids: Sequence[int], media: Sequence[PreparedMedia], tokens: VisionTokens, merge: int,
    encode: Callable[[str], list[int]], video_layout: VideoLayout = "qwen",
) -> MultimodalPrompt:
    """Expand a rendered prompt's placeholders and compute its positions."""
    full, types = expand_placeholders(ids, media, tokens, merge, encode, video_layout)
    positions, delta = rope_index(types, media, merge)
    is_media = torch.tensor(types) != TEXT
    index = torch.full((len(full),), -1, dtype=torch.long)
    index[is_media] = torch.arange(int(is_media.sum()))
    return MultimodalPrompt(full, types, positions, delta, list(media), index)

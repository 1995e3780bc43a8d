"""Vision benchmark (issue #9): the Qwen3.5 ViT at the real 27B / 35B-A3B shape, and TTFT with media.

With random bf16 weights (reference §11.1: depth 27, width 1152, 16 heads of 72, FFN 4304, patch
16, temporal patch 2, 2x2 merge, output width = the text model's), in one run:

1. Encode time of one image (default 1024x1024: grid 1x64x64, 4,096 patches, 1,024 tokens) and of
   one video (default 32 frames of 448x448: grid 16x28x28, 12,544 patches, 3,136 tokens), from
   preprocessed pixels in host memory as ``VisionPipeline`` keeps them (the host-to-device copy
   is inside the time; ``device_pixels_ms`` is the same call with the pixels already on the
   device). Achieved TFLOP/s against the bf16 matmul peak measured in the run.
2. transformers' own ``Qwen3_5VisionModel`` (sdpa) with the same weights, on the same inputs:
   output difference and time, as the baseline.
3. Preprocessing (resize + normalize + patchify on the host, torchvision) when torchvision is
   installed.
4. TTFT through the engine (random text model of the same shape, prefix cache off, one lane):
   a chat prompt with the image (encode + prefill of the expanded prompt + first token) against
   the same chat without the image; the same for the video; and, when torchvision and PIL are
   there, ``LLM.chat`` end to end with a JPEG file (read, decode, preprocess, encode, prefill).

    python perf/bench_vision.py --shape 27b                      # ~2-3 min on an H200
    python perf/bench_vision.py --shape tiny --device cpu --image 256 --frames 4 --frame-size 128  # smoke test
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import bench_ms, matmul_peak_tflops, record, sync
from random_model import SHAPES, random_llm, random_vision_tower, vision_config

from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.sampling import SamplingParams
from ninfer.vision import (
    ByteLRU,
    MultimodalInputs,
    PreparedMedia,
    ProcessorConfig,
    VisionPipeline,
    VisionTokens,
    build_prompt,
    encode_media,
)
from ninfer.vision.processor import frame_timestamps, smart_resize, smart_resize_video

GREEDY = SamplingParams(greedy=True)
QUESTION = "Describe what you see in detail."


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401

        return True
    except ImportError:
        return False


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA, a host timer on CPU (smoke tests)."""
    if device.type == "cuda":
        return bench_ms(fn, warmup=50, rep=300)
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# ------------------------------------------------------------------------------------------ media

def make_image(size: int, processor: ProcessorConfig, seed: int = 0) -> tuple[PreparedMedia, float | None]:
    """A random ``size x size`` RGB image, preprocessed as the pipeline does (host); and the preprocessing ms."""
    cfg = processor.image
    rgb = torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if has_torchvision():
        from ninfer.vision import preprocess_image

        ms = time_ms(lambda: preprocess_image(rgb, cfg), torch.device("cpu"))
        pixels, grid = preprocess_image(rgb, cfg)
    else:  # same grid, random normalised pixels
        h, w = smart_resize(size, size, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels)
        grid, ms = (1, h // cfg.patch_size, w // cfg.patch_size), None
        pixels = torch.rand(grid[1] * grid[2], 3 * cfg.temporal_patch_size * cfg.patch_size ** 2) * 2 - 1
    return PreparedMedia("image", pixels, grid, f"bench-image-{size}"), ms


def make_video(frames: int, size: int, processor: ProcessorConfig, fps: float = 2.0,
               seed: int = 1) -> tuple[PreparedMedia, float | None]:
    """``frames`` random ``size x size`` frames (as sampled at ``fps``), preprocessed; and the preprocessing ms."""
    cfg = processor.video
    clip = torch.randint(0, 256, (frames, 3, size, size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    if has_torchvision():
        from ninfer.vision import preprocess_video

        ms = time_ms(lambda: preprocess_video(clip, cfg), torch.device("cpu"), reps=3)
        pixels, grid = preprocess_video(clip, cfg)
    else:
        t = cfg.temporal_patch_size
        h, w = smart_resize_video(frames, size, size, t, cfg.patch_size * cfg.merge_size, cfg.min_pixels,
                                  cfg.max_pixels)
        grid, ms = (-(-frames // t), h // cfg.patch_size, w // cfg.patch_size), None
        pixels = torch.rand(grid[0] * grid[1] * grid[2], 3 * t * cfg.patch_size ** 2) * 2 - 1
    stamps = frame_timestamps(list(range(frames)), fps, cfg.temporal_patch_size)
    return PreparedMedia("video", pixels, grid, f"bench-video-{frames}x{size}", tuple(stamps)), ms


def encoder_flops(grid: tuple[int, int, int], vc, in_features: int) -> float:
    """FLOPs of one tower call on one item: patch GEMM, blocks (GEMMs + per-segment attention), merger."""
    t, h, w = grid
    n, d, f, unit = t * h * w, vc.hidden_size, vc.intermediate_size, vc.spatial_merge_size ** 2
    block = 2 * n * d * (3 * d + d + 2 * f) + 4 * t * (h * w) ** 2 * d
    merger = 2 * (n // unit) * (unit * d) * (unit * d + vc.out_hidden_size)
    return 2 * n * in_features * d + vc.depth * block + merger


# ------------------------------------------------------------------------------------------ encoder

def hf_vision_model(vc, device: torch.device, dtype: torch.dtype):
    """transformers' ``Qwen3_5VisionModel`` of the same geometry (the MoE model's vision class is the same network)."""
    import transformers

    cfg = transformers.Qwen3_5VisionConfig(
        depth=vc.depth, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size, num_heads=vc.num_heads,
        out_hidden_size=vc.out_hidden_size, patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        spatial_merge_size=vc.spatial_merge_size, num_position_embeddings=vc.num_position_embeddings,
        in_channels=vc.in_channels, hidden_act="gelu_pytorch_tanh")
    with torch.device(device):
        model = transformers.Qwen3_5VisionModel._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@torch.inference_mode()
def bench_encoder(args: argparse.Namespace, tower, media: list[tuple[str, PreparedMedia, float | None]],
                  device: torch.device) -> None:
    vc = tower.config
    peak = matmul_peak_tflops() if device.type == "cuda" else float("nan")
    in_features = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    hf, hf_error = None, None
    if not args.no_hf:
        try:
            start = time.perf_counter()
            hf = hf_vision_model(vc, device, tower.dtype)
            hf.load_state_dict(tower.state_dict(), strict=True)
            print(f"transformers Qwen3_5VisionModel built in {time.perf_counter() - start:.1f} s", flush=True)
        except Exception as err:  # noqa: BLE001 - the baseline is optional; say why it is missing
            hf_error = f"{type(err).__name__}: {err}"
            print(f"transformers vision baseline unavailable: {hf_error}", flush=True)
    for label, item, prep_ms in media:
        t, h, w = item.grid
        tokens = item.num_tokens(tower.merge)
        flops = encoder_flops(item.grid, vc, in_features)
        ms = time_ms(lambda item=item: encode_media(tower, [item]), device)
        on_device = PreparedMedia(item.kind, item.pixels.to(device), item.grid, item.key, item.timestamps)
        device_ms = time_ms(lambda on_device=on_device: encode_media(tower, [on_device]), device)
        extra: dict[str, Any] = dict(patches=t * h * w, tokens=tokens, gflop=round(flops / 1e9, 1),
                                     tokens_per_s=round(tokens / ms * 1e3, 1), host_pixels=True,
                                     device_pixels_ms=round(device_ms, 4))
        if prep_ms is not None:
            extra["preprocess_ms"] = round(prep_ms, 3)
        base_ms = None
        if hf is not None:
            grid_thw = torch.tensor([item.grid], device=device)

            def run_hf(hf=hf, item=item, grid_thw=grid_thw):
                out = hf(hidden_states=item.pixels.to(device), grid_thw=grid_thw)
                return getattr(out, "pooler_output", out)

            ours, theirs = encode_media(tower, [item])[0].float(), run_hf().float()
            extra["max_abs_diff_vs_hf"] = round(float((ours - theirs).abs().max()), 5)
            extra["rel_diff_vs_hf"] = round(float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12)), 6)
            base_ms = time_ms(run_hf, device)
        elif hf_error:
            extra["baseline_error"] = hf_error[:200]
        record("vision_encode", f"{args.shape} {label} grid={t}x{h}x{w} tokens={tokens}", ms,
               achieved=flops / ms / 1e9, limit=peak, unit="TFLOP/s",
               baseline="transformers Qwen3_5VisionModel (sdpa)" if base_ms else None, baseline_ms=base_ms, **extra)
        if prep_ms is not None:
            record("vision_preprocess", f"{label} -> grid={t}x{h}x{w}", prep_ms,
                   achieved=t * h * w / prep_ms * 1e3, limit=float("nan"), unit="patches/s", device="cpu")
    hf = None
    gc.collect()


# ------------------------------------------------------------------------------------------ TTFT

def ttft_once(llm, tower, ids: list[int], prompt=None) -> tuple[float, float]:
    """(TTFT s, encode s) of one request: encode the prompt's media (if any), prefill, first token."""
    engine = llm.engine
    sync(llm.device)
    start = time.perf_counter()
    mm, encoded = None, start
    if prompt is not None:
        embeds = torch.cat(encode_media(tower, prompt.media))
        mm = MultimodalInputs(prompt, embeds)
        sync(llm.device)
        encoded = time.perf_counter()
    req = llm._request(ids, 1, GREEDY, mm=mm)
    engine.add_request(req)
    engine.run_until_done()
    sync(llm.device)
    return req.first_token_time - start, encoded - start


def median_ttft(llm, tower, ids, prompt, reps: int) -> tuple[float, float]:
    ttft_once(llm, tower, ids, prompt)  # warm-up: autotuning of this prompt length's prefill chunks
    runs = [ttft_once(llm, tower, ids, prompt) for _ in range(reps)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def chat_ids(llm, content: Any) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}], enable_thinking=False)
    return llm.tokenizer.encode(text)


def bench_ttft(args: argparse.Namespace, tower, media: list[tuple[str, PreparedMedia, float | None]],
               device: torch.device) -> None:
    longest = max(m.num_tokens(tower.merge) + 32 * m.grid[0] for _, m, _ in media) + 256  # + timestamps, template
    cfg = EngineConfig(max_concurrency=1, max_context=longest, kv_capacity=longest, prefill_chunk=args.chunk,
                       cuda_graphs=True, prefix_cache=False)
    start = time.perf_counter()
    llm = random_llm(args.shape, cfg, device=str(device), num_layers=args.layers, recipe=args.recipe, verbose=True)
    llm.stop_ids = frozenset()
    print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    label = args.recipe or "bf16"
    tokens = VisionTokens.from_ids({}, llm.tokenizer.token_id)
    text_ids = chat_ids(llm, QUESTION)
    text_s, _ = median_ttft(llm, tower, text_ids, None, args.reps)
    record("vision_ttft", f"{args.shape} {label} text only prompt={len(text_ids)}", text_s * 1e3,
           achieved=len(text_ids) / text_s, limit=float("nan"), unit="tok/s", prompt_tokens=len(text_ids),
           media_tokens=0, recipe=label, prefill_chunk=args.chunk)
    for label_media, item, _ in media:
        part = {"type": item.kind, item.kind: f"{item.key}.bin"}  # the template only needs the part's type
        ids = chat_ids(llm, [part, {"type": "text", "text": QUESTION}])
        prompt = build_prompt(ids, [item], tokens, tower.merge, llm.tokenizer.encode)
        seconds, enc = median_ttft(llm, tower, prompt.input_ids, prompt, args.reps)
        n = len(prompt.input_ids)
        record("vision_ttft", f"{args.shape} {label} {label_media} prompt={n}", seconds * 1e3,
               achieved=n / seconds, limit=float("nan"), unit="tok/s", prompt_tokens=n,
               media_tokens=prompt.num_media_tokens, encode_ms=round(enc * 1e3, 3),
               prefill_ms=round((seconds - enc) * 1e3, 3), text_only_ttft_ms=round(text_s * 1e3, 3),
               added_ms_vs_text_only=round((seconds - text_s) * 1e3, 3), recipe=label, prefill_chunk=args.chunk)
    if has_torchvision():
        try:
            chat_end_to_end(args, llm, tower, tokens, label)
        except Exception as err:  # noqa: BLE001 - the end-to-end row is extra; the rows above stand
            print(f"LLM.chat end to end failed: {type(err).__name__}: {err}", flush=True)
    del llm
    gc.collect()


def chat_end_to_end(args: argparse.Namespace, llm, tower, tokens: VisionTokens, label: str) -> None:
    """``LLM.chat`` with a JPEG file: wall time of a 1-token reply (read, decode, preprocess, encode, prefill)."""
    import numpy as np
    from PIL import Image

    size = args.image
    yy, xx = np.mgrid[0:size, 0:size]
    rng = np.random.default_rng(0)  # smooth gradients plus noise: a JPEG of realistic size
    rgb = np.stack([(xx * 255 // size), (yy * 255 // size), ((xx + yy) * 127 // size)], -1)
    rgb = np.clip(rgb + rng.integers(-20, 21, rgb.shape), 0, 255).astype(np.uint8)
    path = Path(tempfile.mkdtemp(prefix="ninfer-vision-")) / "image.jpg"
    Image.fromarray(rgb).save(path, quality=90)
    llm.vision = VisionPipeline(tower, tokens, ProcessorConfig())
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}},
                                             {"type": "text", "text": QUESTION}]}]

    def once() -> tuple[float, int]:
        llm.vision.prepared, llm.vision.embeddings = ByteLRU(1 << 30), ByteLRU(1 << 30)  # no cache hits
        sync(llm.device)
        start = time.perf_counter()
        done = llm.chat(messages, enable_thinking=False, max_new_tokens=1, greedy=True)
        sync(llm.device)
        return time.perf_counter() - start, done.prompt_tokens

    once()
    runs = [once() for _ in range(args.reps)]
    seconds, n = statistics.median(r[0] for r in runs), runs[0][1]
    record("vision_chat_ttft", f"{args.shape} {label} LLM.chat jpeg {size}x{size} prompt={n}", seconds * 1e3,
           achieved=n / seconds, limit=float("nan"), unit="tok/s", prompt_tokens=n, jpeg_bytes=path.stat().st_size,
           recipe=label, prefill_chunk=args.chunk)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--image", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--frames", type=int, default=32, help="video frames (as sampled)")
    parser.add_argument("--frame-size", type=int, default=448, help="video frame side in pixels")
    parser.add_argument("--recipe", default=None, help="text model recipe for the TTFT rows (default bf16)")
    parser.add_argument("--chunk", type=int, default=1024, help="engine prefill chunk")
    parser.add_argument("--reps", type=int, default=5, help="TTFT repetitions (median)")
    parser.add_argument("--layers", type=int, default=None, help="fewer text decoder layers (smoke tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' vision model")
    parser.add_argument("--no-ttft", action="store_true", help="skip the engine (TTFT) part")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    vc = vision_config(args.shape)
    print(f"vision tower: depth {vc.depth}, width {vc.hidden_size}, {vc.num_heads} heads, FFN {vc.intermediate_size}, "
          f"patch {vc.patch_size}, temporal {vc.temporal_patch_size}, merge {vc.spatial_merge_size}, "
          f"out {vc.out_hidden_size}; torchvision {'yes' if has_torchvision() else 'no (random pixels)'}", flush=True)
    tower = random_vision_tower(args.shape, device=str(device), dtype=dtype)
    processor = ProcessorConfig()
    image, image_ms = make_image(args.image, processor)
    video, video_ms = make_video(args.frames, args.frame_size, processor)
    media = [(f"image {args.image}x{args.image}", image, image_ms),
             (f"video {args.frames}x{args.frame_size}x{args.frame_size}", video, video_ms)]
    bench_encoder(args, tower, media, device)
    if not args.no_ttft:
        bench_ttft(args, tower, media, device)


if __name__ == "__main__":
    main()

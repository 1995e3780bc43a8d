"""Fixtures for the vision tests: a tiny composite checkpoint with preprocessor files, media on disk."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # importlib mode: make vision_helpers importable

from tiny_checkpoints import TinyCheckpoint, make_composite
from vision_helpers import make_image, write_preprocessor_files, write_video


@dataclass
class VisionSetup:
    ckpt: TinyCheckpoint
    media_dir: Path


@pytest.fixture(scope="session")
def vision_setup(tmp_path_factory: pytest.TempPathFactory) -> VisionSetup:
    ckpt = make_composite(tmp_path_factory.mktemp("vision_ckpt"), seed=7)
    write_preprocessor_files(ckpt.path)
    media = tmp_path_factory.mktemp("media")
    make_image(90, 140, 1).save(media / "wide.png")
    make_image(200, 60, 2).save(media / "tall.jpg", quality=90)
    make_image(12, 20, 3).save(media / "tiny.png")
    make_image(400, 300, 4).save(media / "big.png")  # over longest_edge: scaled down
    make_image(50, 50, 5, mode="RGBA").save(media / "alpha.png")
    write_video(media / "clip.mp4", frames=16, fps=6, size=(150, 90))
    return VisionSetup(ckpt, media)


@pytest.fixture(scope="session")
def hf_processor(vision_setup: VisionSetup):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(vision_setup.ckpt.path))


@pytest.fixture(scope="session")
def llm(vision_setup: VisionSetup):
    import ninfer

    return ninfer.load(vision_setup.ckpt.path, device="cpu", progress=False)


@pytest.fixture(scope="session")
def pipeline(vision_setup: VisionSetup, llm):
    from ninfer.vision import VisionPipeline

    return VisionPipeline.from_checkpoint(vision_setup.ckpt.path, llm.config, llm.tokenizer.token_id,
                                          device="cpu", dtype=torch.float32)

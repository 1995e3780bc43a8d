"""Shared pytest fixtures: tiny random Qwen3.5 checkpoints with their transformers oracles."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Fork-safety and quiet logs must be set before tokenizers/transformers are imported.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tuners' disk cache (ninfer/kernels/tune_cache.py) stays off: tests must not read choices of earlier
# runs (the GPU tuning tests assert that timing happens) nor write into the user's ~/.cache.
os.environ.setdefault("NINFER_TUNE_CACHE", "off")
# Likewise the tuning tables shipped in the package (ninfer/kernels/shipped.py): a test must time what it
# means to time whatever the package ships for this GPU; tests/kernels/test_shipped_tuning.py turns them on.
os.environ.setdefault("NINFER_SHIPPED_TUNING", "0")

import torch  # noqa: E402

# Without a GPU, Triton kernels run in the interpreter on CPU tensors. This must be decided
# before ninfer's kernel modules are imported, because triton.jit reads it at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TESTS = Path(__file__).resolve().parent
# Make `import ninfer` and `import tiny_checkpoints` work without an installed package and
# whatever pytest import mode is used.
for p in (str(_TESTS.parent), str(_TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

import pytest  # noqa: E402
import transformers  # noqa: E402
from interpreter_patches import skip_nested_language_patches  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    skip_nested_language_patches()

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from tiny_checkpoints import TinyCheckpoint, make_composite, make_dense, make_moe  # noqa: E402


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """Dense ``Qwen3_5ForCausalLM`` checkpoint (fp32, ``model.*`` keys, 4 layers L L L F)."""
    return make_dense(tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """MoE ``Qwen3_5MoeForCausalLM`` checkpoint with per-expert keys (what save_pretrained writes)."""
    return make_moe(tmp_path_factory.mktemp("moe"), expert_layout="per_expert")


@pytest.fixture(scope="session")
def composite_ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """Dense ``Qwen3_5ForConditionalGeneration`` (official layout, tiny ViT, random ``mtp.*``)."""
    return make_composite(tmp_path_factory.mktemp("composite"))


@pytest.fixture(scope="session")
def composite_moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """MoE ``Qwen3_5MoeForConditionalGeneration`` with fused main-layer experts, like official files."""
    return make_composite(tmp_path_factory.mktemp("composite_moe"), moe=True)

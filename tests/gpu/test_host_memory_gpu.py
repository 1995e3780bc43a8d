"""Host copies on the GPU: pinned pool blocks, asynchronous copies that stay exact when the device storage
or a block is reused at once, and the engine's pause / prefix-offload paths through them."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.config import parse_config
from ninfer.models.cache import ModelCache
from ninfer.runtime.host_cache import HostCache
from ninfer.runtime.sampling import SamplingParams
from tiny_checkpoints import TinyCheckpoint, make_dense, text_config_kwargs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# 27B's DeltaNet and attention head geometry over 8 layers: state tensors of 3 MiB, large enough for an
# asynchronous copy to still run when the next kernel is queued.
LAYERS = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
CONFIG = parse_config({"model_type": "qwen3_5_text", **text_config_kwargs(head_dim=256, layer_types=LAYERS),
                       "num_key_value_heads": 4, "num_attention_heads": 24, "linear_num_key_heads": 16,
                       "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128})


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).cpu() for t in tensors]


def _fill(tensors: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors:
        bits = t.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, generator=g, device="cuda", dtype=torch.uint8))


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
def test_async_copies_are_exact_under_immediate_reuse(kv_dtype: str) -> None:
    device_cache = ModelCache(CONFIG, num_pages=40, page_size=64, num_slots=3, device="cuda", dtype=torch.bfloat16,
                              kv_dtype=kv_dtype)
    cache = HostCache(device_cache, limit=4 << 30, block_bytes=4 << 20)
    states, pages_t = device_cache.state_tensors(), device_cache.page_tensors()
    _fill([*states, *pages_t], seed=0)
    pages = list(range(3, 40, 2))
    # both copies span several blocks (a slot's state is 18 MiB, a bf16 page 512 KiB: 8 pages per block)
    assert cache.state_layout.num_blocks > 1 and len(pages) > cache.pages_per_block
    want_slot, want_pages = _bits([s[0] for s in states]), _bits([t[pages] for t in pages_t])
    state, kv = cache.save_slot(0), cache.save_pages(pages)
    assert all(b.data.is_pinned() for b in (*state.blocks, *kv.blocks))
    _fill([*states, *pages_t], seed=1)  # queued right behind the copies, no synchronization
    cache.restore_slot(1, state)
    cache.restore_pages(list(range(len(pages))), kv)
    got_slot, got_pages = _bits([s[1] for s in states]), _bits([t[: len(pages)] for t in pages_t])
    assert all(torch.equal(a, b) for a, b in zip(got_slot, want_slot))
    assert all(torch.equal(a, b) for a, b in zip(got_pages, want_pages))
    # A block given back right after an asynchronous restore serves the next save: the restore must have
    # read it first (the next save waits for the restore's event).
    _fill(states, seed=2)
    cache.restore_slot(2, state)
    ptrs = [b.data.data_ptr() for b in state.blocks]
    cache.release(state)
    again = cache.save_slot(1)  # other bytes into the same blocks
    assert sorted(b.data.data_ptr() for b in again.blocks) == sorted(ptrs)
    assert all(torch.equal(a, b) for a, b in zip(_bits([s[2] for s in states]), want_slot))
    cache.release(again, kv)
    assert cache.pool.used_bytes == 0


PAGE = 16


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> TinyCheckpoint:
    return make_dense(tmp_path_factory.mktemp("hdense"), seed=3)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_engine_pauses_and_offloads_through_pinned_blocks(dense: TinyCheckpoint, kv_dtype: str) -> None:
    """Snapshots and host checkpoints on CUDA: a tiny pool gives a big pool's greedy outputs."""
    def load(**kw) -> ninfer.LLM:
        llm = ninfer.load(dense.path, device="cuda", dtype=torch.float32, kv_dtype=kv_dtype, page_size=PAGE,
                          max_concurrency=3, cuda_graphs=False, progress=False, prefill_chunk=8, **kw)
        llm.stop_ids = frozenset()
        return llm

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 448, (n,), generator=g).tolist() for n in (5, 9, 30, 20, 3, 15)]

    def run(llm: ninfer.LLM) -> list[list[int]]:
        reqs = [llm._request(p, 48, SamplingParams(greedy=True)) for p in prompts]
        llm._run(reqs)
        return [r.output_ids for r in reqs]

    expected = run(load(prefix_cache=False))
    llm = load(kv_capacity=6 * PAGE, pause_host_gib=1.0, prefix_cache=True, checkpoint_interval=16,
               checkpoint_slots=1, host_cache_gib=0.01)
    assert run(llm) == expected
    engine = llm.engine
    assert engine.pauser.stats.snapshots > 0 and engine.prefix.stats.offloaded > 0
    assert engine.runner.host.pool.used_bytes == engine.prefix.host_bytes
    engine.prefix.clear()
    assert engine.runner.host.pool.used_bytes == 0 and engine.runner.host.pool.free_bytes > 0
    allocated = engine.runner.host.pool.allocated
    assert run(llm) == expected and engine.runner.host.pool.allocated == allocated  # the second pass pinned nothing

"""The warm-start marker (:mod:`ninfer.runtime.warm_start`): what names a start's configuration, and a start
that finds its marker skipping its dry passes."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import ninfer
from ninfer.kernels import precompile
from ninfer.runtime import engine as engine_module
from ninfer.runtime import startup, warm_start
from tiny_checkpoints import TinyCheckpoint


@pytest.fixture
def llm(dense_ckpt: TinyCheckpoint):
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)


def test_the_key_names_what_decides_the_kernels(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    model, config = llm.engine.model, llm.engine.config
    key = warm_start.start_key(model, None, config)
    assert key == warm_start.start_key(model, None, config) and len(key) == 32
    # `ninfer warmup` builds its engine without the warm-up, then runs it: the same start.
    assert warm_start.start_key(model, None, dataclasses.replace(config, warmup=not config.warmup)) == key
    assert warm_start.start_key(model, None, dataclasses.replace(config, max_concurrency=1)) != key
    monkeypatch.setenv("NINFER_AUTOTUNE", "off")
    assert warm_start.start_key(model, None, config) != key
    monkeypatch.delenv("NINFER_AUTOTUNE")
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, rms_norm_eps=1e-3))
    assert warm_start.start_key(model, None, config) != key


def test_a_quantized_weight_s_layout_is_part_of_the_key() -> None:
    import torch
    from torch import nn

    from ninfer.quant.linear import QuantLinear
    from ninfer.runtime.engine_config import EngineConfig

    model = nn.Sequential(QuantLinear.from_float(torch.randn(64, 128), "int4-g64"))
    config = EngineConfig()
    key = warm_start.start_key(model, None, config)
    model[0].layout = "fragments"
    assert warm_start.start_key(model, None, config) != key


def test_a_marker_is_found_once_written_and_never_fails_a_start(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert warm_start.triton_cache_dir() == tmp_path / "triton"
    marker = warm_start.WarmMarker(warm_start.triton_cache_dir() / warm_start.MARKERS / "k")
    assert marker.skip_reason() is None
    marker.write()
    assert marker.path.exists() and str(marker.path) in marker.skip_reason()
    monkeypatch.setenv(precompile.ENV, "always")
    assert marker.skip_reason() is None
    (tmp_path / "file").write_text("")
    warm_start.WarmMarker(tmp_path / "file" / "k").write()  # a cache we cannot write: the next start runs its passes


def test_a_start_that_finds_its_marker_skips_its_dry_passes(dense_ckpt: TinyCheckpoint, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # On CPU nothing compiles and no marker is kept; here the engine gets one as on CUDA.
    markers: list[warm_start.WarmMarker] = []
    monkeypatch.setattr(engine_module, "marker_for",
                        lambda model, head, config: markers.append(warm_start.WarmMarker.for_start(
                            model, head, config)) or markers[-1])
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    first = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    assert first.startup.dry_passes_off is None and not markers[0].path.exists()
    first.engine.warm_up()  # what `ninfer warmup` runs; a CUDA start runs it inside load
    assert markers[0].path.exists()
    second = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    assert markers[1] == markers[0] and str(markers[0].path) in second.startup.dry_passes_off
    other = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, progress=False)
    assert markers[2] != markers[0] and other.startup.dry_passes_off is None


def test_a_skipped_dry_pass_is_no_phase_and_the_report_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precompile, "disabled_reason", lambda: None)
    report = startup.begin()
    startup.skip_dry_passes("an earlier start of this configuration compiled its kernels: /m")
    result = startup.parallel_compile(lambda: pytest.fail("no dry pass when skipped"))
    startup.finish()
    assert not result.ran and startup.PARALLEL_COMPILE not in report.phases
    assert report.describe().endswith("; parallel compile off (an earlier start of this configuration compiled "
                                      "its kernels: /m)")
    startup.skip_dry_passes("no report open: nothing to skip")  # an engine built directly skips nothing

"""Engine options are defined once (EngineConfig's field metadata): ``ninfer.load``'s keywords and the commands'
flags share their defaults, units and checks, and errors name the keyword or the flag."""
from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

import ninfer
from cli_testing import run_cli
from ninfer.api.cli import add_serve_parser
from ninfer.cli import build_parser
from ninfer.cli_options import engine_options
from ninfer.runtime.engine_config import MAX_DRAFT_TOKENS, MAX_LANES, EngineConfig
from ninfer.runtime.options import OptionError
from tiny_checkpoints import TinyCheckpoint


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", "m", *argv])


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_one_set_of_defaults() -> None:
    assert EngineConfig.from_options({}) == EngineConfig()
    signature = inspect.signature(ninfer.load).parameters
    for opt in EngineConfig.options():
        assert signature[opt.name].default == opt.default, opt.name
    serve = _serve_args()
    for opt in EngineConfig.options():
        assert getattr(serve, opt.name) == opt.default, opt.name
    assert EngineConfig.from_options(engine_options(serve)) == EngineConfig()
    assert (EngineConfig().max_concurrency, EngineConfig().max_context) == (4, 8192)


def test_bounds_match_the_runtime() -> None:
    from ninfer.runtime.speculative import MAX_DRAFT_TOKENS as RUNTIME_MAX_DRAFTS

    assert MAX_DRAFT_TOKENS == RUNTIME_MAX_DRAFTS
    with pytest.raises(ValueError, match=f"1..{MAX_LANES}"):
        from ninfer.runtime.scheduler import Scheduler

        Scheduler(max_concurrency=MAX_LANES + 1, max_context=8, page_size=4, prefill_chunk=4, pages=None, slots=None)


def test_units_and_derived_fields() -> None:
    cfg = EngineConfig.from_options({"host_cache_gib": 0.5, "pause_host_gib": 1, "host_prepin_gib": 0.25,
                                     "spec": "mtp", "draft_tokens": 2, "cuda_graphs": False, "kv_capacity": "auto"})
    assert (cfg.host_cache_bytes, cfg.pause_host_bytes, cfg.host_prepin_bytes) == (1 << 29, 1 << 30, 1 << 28)
    assert cfg.draft_tokens == 2 and not cfg.cuda_graphs and cfg.kv_capacity == "auto"
    assert EngineConfig.from_options({"spec": "mtp"}).draft_tokens == 3
    assert EngineConfig.from_options({}).draft_tokens == 0
    args = _serve_args("--host-cache-gib", "0.5", "--pause-host-gib", "1", "--host-prepin-gib", "0.25", "--spec", "mtp",
                       "--draft-tokens", "2", "--no-cuda-graphs", "--kv-capacity", "auto")
    assert EngineConfig.from_options(engine_options(args)) == cfg


@pytest.mark.parametrize("options, message", [
    ({"max_concurrency": 0}, "max_concurrency must be 1-8, got 0"),
    ({"max_concurrency": 2.0}, "max_concurrency must be an integer, got 2.0"),
    ({"max_context": True}, "max_context must be an integer, got True"),
    ({"kv_capacity": "lots"}, "kv_capacity must be an integer, 'auto' or None, got 'lots'"),
    ({"kv_dtype": "fp4"}, "kv_dtype must be one of 'auto', 'bf16', 'fp8', 'int8', got 'fp4'"),
    ({"host_cache_gib": -1}, "host_cache_gib must be >= 0, got -1.0"),
    ({"pause_host_gib": float("inf")}, "pause_host_gib must be finite, got inf"),
    ({"spec": "eagle"}, "spec must be one of None, 'mtp', got 'eagle'"),
    ({"spec": "mtp", "draft_tokens": 8}, "draft_tokens must be 1-7, got 8"),
    ({"draft_tokens": 2}, "draft_tokens needs spec"),
    ({"prefix_cache": "no"}, "prefix_cache must be True or False, got 'no'"),
    ({"prefix_cache": False, "checkpoint_slots": 2}, "checkpoint_slots conflicts with prefix_cache=False"),
])
def test_python_errors_name_the_keyword(options: dict, message: str) -> None:
    with pytest.raises(OptionError) as err:
        ninfer.load(**options)
    assert str(err.value) == message


def test_unknown_and_bench_only_keywords_are_refused() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_contxt' \\(did you mean 'max_context'\\?\\)"):
        ninfer.load(max_contxt=10)
    with pytest.raises(TypeError, match="'forced_accept'"):
        ninfer.load(forced_accept=1)
    with pytest.raises(TypeError, match="'max_pending'"):
        ninfer.load(max_pending=1)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-concurrency", "9"], "--max-concurrency must be 1-8, got 9"),
    (["serve", "--kv-capacity", "lots"], "--kv-capacity expects an integer or 'auto', got 'lots'"),
    (["serve", "--host-cache-gib", "-2"], "--host-cache-gib must be >= 0, got -2.0"),
    (["serve", "--draft-tokens", "2"], "--draft-tokens needs --spec"),
    (["generate", "--prompt", "x", "--draft-tokens", "2"], "--draft-tokens needs --spec"),
    (["warmup", "--draft-tokens", "2"], "--draft-tokens needs --spec"),
    (["serve", "--no-prefix-cache", "--host-cache-gib", "1"], "--host-cache-gib conflicts with --no-prefix-cache"),
    (["serve", "--max-image-pixels", "100"], "--max-image-pixels needs --vision"),
    (["serve", "--no-remote-media"], "--no-remote-media needs --vision"),
    (["chat", "--max-context", "1"], "--max-context must be >= 2, got 1"),
])
def test_flag_errors_name_the_flag(capsys, argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_commands_get_the_engine_flags_and_no_bench_knobs() -> None:
    flags = {opt.flag for opt in EngineConfig.options()}
    assert all(opt.flag_help for opt in EngineConfig.options() if opt.kind is bool)  # --no-X says what X is off
    for command, fixed in (("serve", set()), ("warmup", {"--no-warmup"}), ("generate", {"--max-concurrency"}),
                           ("chat", {"--max-concurrency"})):
        text = _subparser(command).format_help()
        assert all(flag in text for flag in flags - fixed), command
        assert not any(flag in text for flag in fixed), command
        assert "forced" not in text
    assert "--max-context" not in _subparser("ppl").format_help()


def test_generate_flags_reach_the_engine(capsys, monkeypatch, dense_ckpt: TinyCheckpoint) -> None:
    loaded = []
    real = ninfer.load
    monkeypatch.setattr(ninfer, "load", lambda *a, **kw: loaded.append(real(*a, **kw)) or loaded[-1])
    code, _, err = run_cli(capsys, "generate", str(dense_ckpt.path), "--prompt", "hi", "--max-new", "2", "--device",
                           "cpu", "--max-context", "300", "--kv-capacity", "640", "--prefill-chunk", "32",
                           "--page-size", "16", "--checkpoint-interval", "128", "--pause-host-gib", "0.5",
                           "--kv-dtype", "bf16", "--no-warmup", "--no-cuda-graphs")
    assert code == 0, err
    cfg = loaded[0].engine.config
    assert dataclasses.asdict(cfg) == dataclasses.asdict(EngineConfig(
        max_concurrency=1, max_context=300, kv_capacity=640, prefill_chunk=32, page_size=16,
        checkpoint_interval=128, pause_host_bytes=1 << 29, kv_dtype="bf16", warmup=False, cuda_graphs=False))
    assert loaded[0].engine.plan.num_pages == 640 // 16


def test_the_load_progress_bar_reaches_its_total(monkeypatch, composite_ckpt: TinyCheckpoint) -> None:
    import ninfer.checkpoint as checkpoint

    bars = []

    class Bar:
        def __init__(self, total: int, **kw) -> None:
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n: int) -> None:
            self.n += n

        def close(self) -> None:
            pass

    monkeypatch.setattr(checkpoint, "tqdm", Bar)
    ninfer.load(composite_ckpt.path, device="cpu")  # vision weights in the shards, skipped by a text load
    assert bars and bars[0].n == bars[0].total > 0

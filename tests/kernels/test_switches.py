"""The on/off environment switches (:func:`ninfer.kernels.dispatch.env_switch`): their defaults, the accepted
spellings of on and off, and a clear error naming the variable for anything else (a typo never silently picks a
path)."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels import dispatch, shipped
from ninfer.kernels.deltanet.mixer import fused_decode_enabled

HOPPER = torch.device("cpu")  # read as compute capability 9.0 by the test below

SWITCHES = [  # (variable, reader, default)
    ("NINFER_PDL", lambda: dispatch.pdl_enabled(HOPPER), True),
    ("NINFER_DEFERRED_NORM", dispatch.deferred_norm, True),
    ("NINFER_DEFERRED_NORM_MOE", dispatch.deferred_norm_in_moe, False),
    ("NINFER_FUSED_PROLOGUE", dispatch.fused_prologue, True),
    ("NINFER_MOE_NORM", dispatch.norm_in_moe_combine, True),
    ("NINFER_NORM_IN_GEMM", dispatch.norm_in_gemm, True),
    ("NINFER_MOE_DOWN_EARLY", dispatch.moe_down_early, True),
    ("NINFER_DELTANET_EARLY", dispatch.deltanet_early, True),
    ("NINFER_FLOAT_GEMV_EARLY", lambda: dispatch.float_gemv_early(1), False),  # at batch 1; by rows below
    ("NINFER_ROUTE_PREFETCH", dispatch.route_prefetch, False),
    ("NINFER_FRAG_ASYNC", dispatch.frag_async, False),
    ("NINFER_FRAG_KSPLIT", dispatch.frag_ksplit, False),
    ("NINFER_FUSED_DELTANET_DECODE", fused_decode_enabled, True),
    ("NINFER_SHIPPED_TUNING", shipped.enabled, True),
]


@pytest.mark.parametrize("name, read, default", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_defaults_spellings_and_errors(monkeypatch: pytest.MonkeyPatch, name: str, read, default: bool) -> None:
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    monkeypatch.delenv(name, raising=False)
    assert read() is default
    monkeypatch.setenv(name, "")
    assert read() is default
    for values, want in ((("1", "on", "True", " yes "), True), (("0", "off", "FALSE", "no"), False)):
        for value in values:
            monkeypatch.setenv(name, value)
            assert read() is want, value
    monkeypatch.setenv(name, "2")
    with pytest.raises(ValueError, match=f"{name}='2'"):
        read()


def test_the_float_gemv_starts_early_from_eight_tokens_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NINFER_FLOAT_GEMV_EARLY", raising=False)
    assert [dispatch.float_gemv_early(rows) for rows in (1, 4, 7, 8, 16)] == [False, False, False, True, True]
    monkeypatch.setenv("NINFER_FLOAT_GEMV_EARLY", "1")
    assert dispatch.float_gemv_early(1)
    monkeypatch.setenv("NINFER_FLOAT_GEMV_EARLY", "0")
    assert not dispatch.float_gemv_early(16)


def test_pdl_needs_compute_capability_9(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_PDL", "1")
    assert not dispatch.pdl_enabled(torch.device("cpu"))  # the CPU: no griddepcontrol
    monkeypatch.setattr(dispatch, "_capability", lambda device: (8, 9))
    assert not dispatch.pdl_enabled(HOPPER)


def test_the_moe_blocks_follow_the_deferred_norm_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_DEFERRED_NORM_MOE", "1")
    monkeypatch.setenv("NINFER_DEFERRED_NORM", "0")
    assert not dispatch.deferred_norm_in_moe()

"""The on/off environment switches of :mod:`ninfer.kernels.dispatch`: their defaults, ``0`` and ``1``, and a clear
error naming the variable for anything else (a typo never silently picks a path)."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels import dispatch

HOPPER = torch.device("cpu")  # read as compute capability 9.0 by the fixture below

SWITCHES = [  # (variable, reader, default)
    ("NINFER_PDL", lambda: dispatch.pdl_enabled(HOPPER), True),
    ("NINFER_DEFERRED_NORM", dispatch.deferred_norm, True),
    ("NINFER_DEFERRED_NORM_MOE", dispatch.deferred_norm_in_moe, False),
]


@pytest.mark.parametrize("name, read, default", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_defaults_values_and_errors(monkeypatch: pytest.MonkeyPatch, name: str, read, default: bool) -> None:
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    monkeypatch.delenv(name, raising=False)
    assert read() is default
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv(name, value)
        assert read() is want
    monkeypatch.setenv(name, "on")
    with pytest.raises(ValueError, match=f"{name}='on'"):
        read()


def test_pdl_needs_compute_capability_9(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_PDL", "1")
    assert not dispatch.pdl_enabled(torch.device("cpu"))  # the CPU: no griddepcontrol
    monkeypatch.setattr(dispatch, "_capability", lambda device: (8, 9))
    assert not dispatch.pdl_enabled(HOPPER)

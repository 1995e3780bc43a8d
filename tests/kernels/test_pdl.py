"""Which small kernels take part in programmatic dependent launch (:mod:`ninfer.kernels.pdl`): they trigger where
PDL is on; they are launched with PDL, and then wait at their start, only with ``NINFER_PDL_WAITS=1``; a launch
with PDL always comes with the wait."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels import dispatch
from ninfer.kernels.pdl import Pdl, small_kernel_pdl

DEVICE = torch.device("cpu")  # read as compute capability 9.0 below


@pytest.mark.parametrize("pdl_on, waits, want", [
    (None, None, Pdl(wait=False, trigger=True)),
    ("1", "1", Pdl(wait=True, trigger=True)),
    ("0", "1", Pdl()),  # no PDL at all: neither
    ("1", "0", Pdl(wait=False, trigger=True)),
])
def test_the_parts_follow_the_switches(monkeypatch: pytest.MonkeyPatch, pdl_on, waits, want: Pdl) -> None:
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    for name, value in (("NINFER_PDL", pdl_on), ("NINFER_PDL_WAITS", waits)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    got = small_kernel_pdl(DEVICE)
    assert got == want
    assert got.constexprs() == {"PDL_WAIT": want.wait, "PDL_TRIGGER": want.trigger}
    assert got.options() == ({"launch_pdl": True} if want.wait else {})


def test_nothing_off_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_PDL_WAITS", "1")
    assert small_kernel_pdl(DEVICE) == Pdl()  # the CPU
    monkeypatch.setattr(dispatch, "_capability", lambda device: (8, 9))
    assert small_kernel_pdl(DEVICE) == Pdl()
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    monkeypatch.setenv("NINFER_PDL_WAITS", "sometimes")
    with pytest.raises(ValueError, match="NINFER_PDL_WAITS='sometimes'"):
        small_kernel_pdl(DEVICE)

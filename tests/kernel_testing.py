"""Shared pieces of the row-wise kernel tests: NaN-poisoned allocations and a relative-error check."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers allocate their outputs: make fresh float allocations NaN so unwritten elements show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Finite output of the reference's shape and dtype, within ``tol`` relative (Frobenius) error."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < tol, f"relative error {err:.2e}"

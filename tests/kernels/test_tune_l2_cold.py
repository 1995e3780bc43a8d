"""Which tuners time their decode candidates L2-cold (``NINFER_TUNE_L2_COLD``, :mod:`ninfer.kernels.quant_gemm.timing`):
the MoE expert GEMMs' by default, every one or none on request, and a clear error for anything else."""
from __future__ import annotations

import pytest

from ninfer.kernels.quant_gemm.timing import L2_COLD_ENV, l2_cold


@pytest.mark.parametrize(("value", "dense", "experts"), [
    (None, False, True), ("", False, True), ("experts", False, True), ("ALL", True, True), ("none", False, False)])
def test_the_expert_tuner_times_cold_by_default(value: str | None, dense: bool, experts: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv(L2_COLD_ENV, raising=False)
    else:
        monkeypatch.setenv(L2_COLD_ENV, value)
    assert (l2_cold(), l2_cold(experts=True)) == (dense, experts)


def test_an_unknown_value_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(L2_COLD_ENV, "1")
    with pytest.raises(ValueError, match="NINFER_TUNE_L2_COLD='1'.*experts, all, none"):
        l2_cold(experts=True)

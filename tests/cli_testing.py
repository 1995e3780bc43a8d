"""Running the ``ninfer`` command in-process for the CLI tests."""
from __future__ import annotations

import pytest

from ninfer.cli import main
from ninfer.llm import LLM


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``ninfer ARGV``."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every engine request the command makes (import it into a test module to use it)."""
    seen: list = []
    real = LLM._run

    def run(self, reqs, *args, **kwargs):
        seen.extend(reqs)
        return real(self, reqs, *args, **kwargs)

    monkeypatch.setattr(LLM, "_run", run)
    return seen

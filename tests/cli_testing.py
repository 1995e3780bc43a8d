"""Running the ``ninfer`` command in-process for the CLI tests."""
from __future__ import annotations

import pytest

from ninfer.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``ninfer ARGV``."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err

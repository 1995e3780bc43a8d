"""The Python API runs without the server's dependencies (Starlette, uvicorn) installed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import builtins
real = builtins.__import__
def refuse_server(name, *args, **kwargs):
    if name.split('.')[0] in ('starlette', 'uvicorn'):
        raise ModuleNotFoundError(f"No module named {name!r}")
    return real(name, *args, **kwargs)
builtins.__import__ = refuse_server
import ninfer
llm = ninfer.load(device='cpu', progress=False, max_context=128)
print(repr(llm.generate('hi', max_new_tokens=3).text))
"""


def test_generate_needs_no_http_server_packages() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]

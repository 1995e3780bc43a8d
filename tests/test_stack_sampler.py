"""perf/stack_sampler.py: the script runs as __main__ with its arguments, and the samples name where it is."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_samples_name_the_function_the_script_is_in(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import sys, time\n\ndef waiting_here():\n    time.sleep(1.0)\n\n"
                      "if __name__ == '__main__':\n    print('args', sys.argv[1:])\n    waiting_here()\n")
    out = subprocess.run([sys.executable, str(ROOT / "perf" / "stack_sampler.py"), "--every", "0.3", str(script),
                          "--flag", "1"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "args ['--flag', '1']" in out
    assert any(line.startswith("[stack ") and "waiting_here" in line for line in out.splitlines()), out


def test_start_samples_the_main_thread_until_stopped(capsys) -> None:
    """In-process use (bench_startup's children until ready): samples while running, none once stopped."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "perf"))
    import stack_sampler

    def sampled_here() -> None:
        time.sleep(0.5)

    stop = stack_sampler.start(0.1, __file__)
    sampled_here()
    stop.set()
    time.sleep(0.3)  # a sample in flight finishes
    lines = capsys.readouterr().out.splitlines()
    assert any("sampled_here" in line for line in lines), lines
    time.sleep(0.3)
    assert capsys.readouterr().out == ""  # stopped
    assert threading.main_thread().is_alive()

"""perf/snapshot.sh and the commit that benchmark records name: a device call's copy has no git history of its
own, so the snapshot writes ``.commit`` and ``perf/common.py`` records that."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _common(root: Path):
    spec = importlib.util.spec_from_file_location("perf_common_under_test", root / "perf" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_snapshot_names_its_commit(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "perf").mkdir(parents=True)
    for name in ("snapshot.sh", "common.py", "gpu_runbook.sh"):
        (repo / "perf" / name).write_bytes((ROOT / "perf" / name).read_bytes())
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "a commit")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    subprocess.run(["bash", "perf/snapshot.sh"], cwd=repo, check=True, capture_output=True)
    snap = repo / ".snap"
    assert (snap / ".commit").read_text().strip() == head
    assert (snap / "perf" / "gpu_runbook.sh").is_file() and (snap / ".devcache").is_dir()
    (snap / ".commit").write_text("abc1234\n")  # the copy's own git metadata, if any, is not consulted
    assert _common(snap).source_commit() == "abc1234"
    assert _common(repo).source_commit() == head  # no .commit: git

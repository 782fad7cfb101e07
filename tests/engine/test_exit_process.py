"""exit_process (detr_irpe/engine/distributed.py): a program's exit; a torchrun worker's
ends with its exit handlers run and its output flushed, without the C++ static
destructors (which aborted a finished 2-process CPU run about once in 40-60)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from detr_irpe.engine import distributed
from detr_irpe.engine.distributed import exit_process

ROOT = Path(__file__).resolve().parents[2]


def test_a_single_process_exits_as_sys_exit_does(monkeypatch) -> None:
    monkeypatch.setattr(distributed, "_JOINED_GROUP_OF_SEVERAL", [False])
    with pytest.raises(SystemExit) as stop:
        exit_process(4)
    assert stop.value.code == 4


def test_a_worker_of_several_runs_its_exit_handlers_and_flushes(tmp_path: Path) -> None:
    marker = tmp_path / "handler_ran"
    code = textwrap.dedent(f"""
        import atexit, logging, pathlib, sys
        from detr_irpe.engine import distributed
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
        atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text("yes"))
        distributed._JOINED_GROUP_OF_SEVERAL[0] = True
        sys.stdout.write("last words without a newline")
        logging.getLogger("x").info("a logged line")
        distributed.exit_process(3)
        print("never")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "last words without a newline"
    assert "a logged line" in proc.stderr and marker.read_text() == "yes"

"""exit_process (detr_irpe/utils/process.py): a program's exit; a torchrun worker's
ends with its exit handlers run and its output flushed, without the C++ static
destructors (which aborted a finished 2-process CPU run about once in 40-60)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from detr_irpe.utils import process
from detr_irpe.utils.process import exit_process

ROOT = Path(__file__).resolve().parents[2]


def test_a_single_process_exits_as_sys_exit_does(monkeypatch) -> None:
    monkeypatch.setattr(process, "_JOINED_GROUP_OF_SEVERAL", [False])
    with pytest.raises(SystemExit) as stop:
        exit_process(4)
    assert stop.value.code == 4


def test_a_worker_of_several_runs_its_exit_handlers_and_flushes(tmp_path: Path) -> None:
    marker = tmp_path / "handler_ran"
    code = textwrap.dedent(f"""
        import atexit, logging, pathlib, sys
        from detr_irpe.utils import process
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
        atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text("yes"))
        process.joined_group_of_several()
        sys.stdout.write("last words without a newline")
        logging.getLogger("x").info("a logged line")
        process.exit_process(3)
        print("never")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "last words without a newline"
    assert "a logged line" in proc.stderr and marker.read_text() == "yes"


def test_the_tools_import_no_torch_for_the_exit() -> None:
    """cli/args.py (imported before the arguments are parsed) reaches exit_process
    without importing torch."""
    code = "import sys, detr_irpe.cli.args; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.strip()
    assert out == "False"

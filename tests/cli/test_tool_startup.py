"""Tools start quickly: ``--help`` and an argument error come back without importing
torch (each tool's module parses its arguments before it imports its program)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

# Each console script's module (setup.cfg) and the demo's.
SPLIT = ["train", "eval", "predict", "visualize", "export", "convert", "ablate", "submit",
         "demo", "benchmark", "synthetic", "data"]

_PROBE = """
import sys
from detr_irpe.cli.{tool} import main
for argv, status in ((["--help"], 0), (["--no-such-flag"], 2)):
    try:
        main(argv)
    except SystemExit as stop:
        assert stop.code == status, (argv, stop.code)
    else:
        raise AssertionError(f"{{argv}} did not exit")
print("torch imported" if "torch" in sys.modules else "no torch")
"""


def _probe(tool: str) -> str:
    done = subprocess.run([sys.executable, "-c", _PROBE.format(tool=tool)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("tool", SPLIT)
def test_help_and_argument_errors_need_no_torch(tool: str) -> None:
    assert _probe(tool) == "no torch"


def test_every_tool_module_is_probed() -> None:
    """A new tool's module (detr_irpe/cli/<tool>.py with a main) is split or listed here."""
    modules = {p.stem for p in (ROOT / "detr_irpe" / "cli").glob("*.py")
               if "def main(" in p.read_text()}
    # submit_job: what runs on each task of a submitted job (no parser of its own)
    assert modules - {"submit_job"} == set(SPLIT)


def test_the_synthetic_tool_names_the_generator_s_choices() -> None:
    from detr_irpe.cli import synthetic as cli
    from detr_irpe.data import synthetic

    assert (cli.SHAPES, cli.DEFAULT_CLASSES, cli.BACKGROUNDS) == (
        synthetic.SHAPES, synthetic.DEFAULT_CLASSES, synthetic.BACKGROUNDS)


def test_the_parsers_name_the_librarys_values() -> None:
    """What a parser names without importing torch (choices, defaults in the help) is the
    value of the library behind it."""
    from detr_irpe.cli import convert, data, demo, export
    from detr_irpe.cli.programs import demo as demo_program
    from detr_irpe.data.convert import FORMATS
    from detr_irpe.export import MIN_OPSET
    from detr_irpe.irpe import RPE_INIT_MODES

    assert export.MIN_OPSET == MIN_OPSET
    assert convert.RPE_INIT_MODES == RPE_INIT_MODES
    assert data.FORMATS == FORMATS
    steps_help = next(a.help for a in demo.build_parser()._actions if a.dest == "steps")
    assert f"~{round(100 * demo_program.DROP_AT)}%%" in steps_help

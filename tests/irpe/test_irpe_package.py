"""``detr_irpe.irpe`` is a plug-in: importing it, or any module in it, loads nothing else of
the package but the shared attention parts it is built on (``detr_irpe.attention.dropout``)."""

from __future__ import annotations

import json
import subprocess
import sys

# a fresh interpreter (this test process has imported much of the package already) that
# imports detr_irpe.irpe and every module under it, then lists the loaded detr_irpe modules
_PROBE = """
import importlib, json, pkgutil, sys
import detr_irpe.irpe as irpe
names = [m.name for m in pkgutil.walk_packages(irpe.__path__, "detr_irpe.irpe.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names,
                  "loaded": sorted(m for m in sys.modules if m.startswith("detr_irpe"))}))
"""


def test_irpe_imports_no_other_part_of_the_package() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                            check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "detr_irpe.irpe.naive" in report["modules"]  # the walk found the modules
    allowed = ("detr_irpe", "detr_irpe.irpe", "detr_irpe.attention", "detr_irpe.attention.dropout")
    outside = [m for m in report["loaded"] if m not in allowed
               and not m.startswith("detr_irpe.irpe.")]
    assert outside == []

"""What is wrong with the files of a dataset being converted: one line per bad case,
naming the file (and line or object), collected over the whole dataset before anything
is written, so that one run of the converter lists every problem."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from detr_irpe.errors import DatasetError
from detr_irpe.utils.files import atomic_write_text, write_error
from detr_irpe.utils.text import plural

__all__ = ["PROBLEMS_FILE", "Problem", "Problems"]

logger = logging.getLogger(__name__)

# Every problem of a refused conversion, one a line, in the output folder.
PROBLEMS_FILE = "conversion_problems.txt"
# Problems shown in the error message (all of them are in PROBLEMS_FILE).
SHOWN = 30


@dataclass(frozen=True)
class Problem:
    """One bad case: ``where`` (``labels/a.txt line 3``, ``Annotations/b.xml``) and what."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass
class Problems:
    """The problems of one conversion, and the fixes made instead with ``--fix``."""

    found: list[Problem] = field(default_factory=list)

    def add(self, where: str | Path, what: str) -> None:
        self.found.append(Problem(str(where), what))

    def __len__(self) -> int:
        return len(self.found)

    def refuse(self, out_dir: Path, fix_flag: str = "--fix") -> None:
        """Raise :class:`DatasetError` listing the problems (all of them written to
        ``out_dir / PROBLEMS_FILE``); nothing when there are none."""
        if not self.found:
            return
        lines = [str(p) for p in self.found]
        listed = out_dir / PROBLEMS_FILE
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise write_error(listed, err) from None
        atomic_write_text(listed, "\n".join(lines) + "\n")
        more = (f"\n  ... and {len(lines) - SHOWN} more" if len(lines) > SHOWN else "")
        raise DatasetError(
            f"{plural(len(lines), 'problem')} in the source annotations, nothing converted "
            f"(every one in {listed}; {fix_flag} drops the bad lines / files and clips boxes "
            f"that reach outside the image):\n  " + "\n  ".join(lines[:SHOWN]) + more)

    def log_fixed(self) -> None:
        """Log each problem as fixed (``--fix``): one warning line each."""
        for problem in self.found:
            logger.warning("fixed: %s", problem)

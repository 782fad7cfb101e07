"""How a program's process ends (no torch here: the tools import it before parsing).

:func:`exit_process` is ``sys.exit`` for a program's entry point, except in a process that
was one of several in a process group (a ``torchrun`` worker, recorded by
:func:`~detr_irpe.engine.distributed.init_distributed` through
:func:`joined_group_of_several`): there the exit handlers run, the output is flushed and
the process ends without the C++ static destructors. On a busy 2-core machine about one
finished 2-process CPU training in 40-60 had a worker abort after its last line in them
("terminate called without an active exception", SIGABRT after the interpreter had
finished), and torchrun then reported the whole run as failed; 0 in 100 ended so with
this exit (Intel Xeon AMX, 2026-12-04).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_process", "joined_group_of_several"]

# whether this process joined a process group of two or more processes
_JOINED_GROUP_OF_SEVERAL = [False]


def joined_group_of_several() -> None:
    """Record that this process is one of several in a process group."""
    _JOINED_GROUP_OF_SEVERAL[0] = True


def exit_process(status: int) -> NoReturn:
    """End the process with ``status`` (see the module docstring)."""
    if not _JOINED_GROUP_OF_SEVERAL[0]:
        sys.exit(status)
    atexit._run_exitfuncs()  # noqa: SLF001 (the handlers os._exit would skip)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)

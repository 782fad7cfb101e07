"""``model.import``: modules a config imports before it is validated (they register
backbones, bucket methods or detector families)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from collections.abc import Iterable
from typing import Any

from detr_irpe.errors import ConfigError

__all__ = ["import_modules"]

logger = logging.getLogger(__name__)


def import_modules(names: Iterable[str]) -> None:
    """Import the ``model.import`` modules (already imported ones are not run again).

    A module is looked up on ``sys.path`` and in the working directory (added while
    importing, as ``python -m`` would have it).

    Raises:
        ConfigError: a module that is missing or whose import ends in any way (an
            exception, ``SystemExit``, ``KeyboardInterrupt``), named with the place.
    """
    names = list(names)
    if not names:
        return
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        for name in names:
            _import_one(name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import_one(name: Any) -> None:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"model.import: expected module names such as my_pkg.my_module, "
                          f"got {name!r}")
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise ConfigError(
                f"model.import: no module named {err.name!r} (looked on sys.path and in "
                f"{os.getcwd()}); install the package or add its folder to PYTHONPATH"
            ) from None
        raise _import_failure(name, err) from err
    except BaseException as err:  # noqa: BLE001 - the user's module ended its import
        # in any way (an exception, sys.exit(), Ctrl-C): name where, in one line
        raise _import_failure(name, err) from err
    logger.info("model.import: imported %s", name)


def _import_failure(name: str, err: BaseException) -> ConfigError:
    frames = traceback.extract_tb(err.__traceback__)
    place = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    first = next(iter(str(err).splitlines()), "")
    if isinstance(err, SystemExit):
        first = f"the module called sys.exit({err.code!r}) while it was imported"
    elif isinstance(err, KeyboardInterrupt):
        first = "interrupted while it was imported"
    return ConfigError(f"model.import: importing {name!r} failed{place}: "
                       f"{type(err).__name__}: {first}")

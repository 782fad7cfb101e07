"""The command-line programs (``detr-irpe-train``, ``detr-irpe-eval`` ...).

Each module here has a ``main(argv=None) -> int``; ``tools/*.py`` and the console
scripts declared in ``setup.cfg`` only call it. :mod:`detr_irpe.cli.common` holds
what they share: one override syntax, the device flag and the exit statuses.
"""

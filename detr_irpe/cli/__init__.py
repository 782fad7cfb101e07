"""The command-line programs (``detr-irpe-train``, ``detr-irpe-eval`` ...).

Each tool's module here has a ``main(argv=None) -> int`` and its parser; ``tools/*.py``
and the console scripts declared in ``setup.cfg`` only call it. It parses with
:mod:`detr_irpe.cli.args` (one override syntax, the device flag, the exit statuses; no
torch) and imports its program from :mod:`detr_irpe.cli.programs` only after parsing.
"""

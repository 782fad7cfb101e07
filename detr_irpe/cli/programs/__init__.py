"""What each tool does once its arguments are parsed (these import torch): a tool's module
in :mod:`detr_irpe.cli` holds its parser and ``main`` and imports its program here only
after parsing, so that ``--help`` and argument errors come back at once."""

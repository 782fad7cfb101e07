"""Print the package's shape as one table: files, lines, long functions, functions with many
parameters, and the two counts of issue 48 (lines outside the encodings' modules that name an
encoding; lines outside ``data/transforms.py`` that test ``data.augmentation`` by name).

    python tools/code_shape.py [--root detr_irpe] [--long 80] [--params 8] [--list]

The counts use the same patterns as the project's before-stop check, so the numbers in an
issue note and the check agree. Copy-pasted code is counted by the ``duplicates`` tool, not here.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A line that names an encoding outside the encodings' own folders.
ENCODING_NAME = re.compile(r"\brope\b|rope_|is_rope_key|position_embedding\s*(==|!=|in)")
ENCODING_HOMES = ("rope/", "irpe/", "encodings/")
# A line that tests the augmentation name (a family switch in disguise).
AUGMENTATION_TEST = re.compile(r"augmentation\s*(==|!=|in)\s")
AUGMENTATION_HOME = "data/transforms.py"


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")])


def measure(package: Path, long: int, params: int) -> dict[str, list[str] | int]:
    files = sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
    shape: dict[str, list[str] | int] = {"files": len(files), "lines": 0, "long": [],
                                          "params": [], "encoding": [], "augmentation": []}
    for path in files:
        rel = path.relative_to(package).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        shape["lines"] += len(lines)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{rel}:{node.lineno} {node.name}"
                if node.end_lineno - node.lineno + 1 > long:
                    shape["long"].append(f"{where} ({node.end_lineno - node.lineno + 1} lines)")
                if _parameters(node) > params:
                    shape["params"].append(f"{where} ({_parameters(node)} parameters)")
        for number, line in enumerate(lines, 1):
            if line.strip().startswith("#"):
                continue
            if not rel.startswith(ENCODING_HOMES) and ENCODING_NAME.search(line):
                shape["encoding"].append(f"{rel}:{number}: {line.strip()[:90]}")
            if rel != AUGMENTATION_HOME and AUGMENTATION_TEST.search(line):
                shape["augmentation"].append(f"{rel}:{number}: {line.strip()[:90]}")
    return shape


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="detr_irpe", help="the package folder")
    parser.add_argument("--long", type=int, default=80, help="a long function has more lines")
    parser.add_argument("--params", type=int, default=8, help="too many parameters: more")
    parser.add_argument("--list", action="store_true", help="list what each count counts")
    args = parser.parse_args(argv)
    shape = measure(ROOT / args.root, args.long, args.params)
    rows = [("Python files", shape["files"]), ("lines", shape["lines"]),
            (f"functions over {args.long} lines", len(shape["long"])),
            (f"functions with more than {args.params} parameters", len(shape["params"])),
            ("lines naming an encoding outside rope/, irpe/, encodings/", len(shape["encoding"])),
            ("lines testing data.augmentation by name outside data/transforms.py",
             len(shape["augmentation"]))]
    width = max(len(name) for name, _ in rows)
    print(f"| {'measure':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value:>5} |")
    if args.list:
        for key in ("long", "params", "encoding", "augmentation"):
            print(f"\n{key}:")
            print("\n".join(f"  {item}" for item in shape[key]))


if __name__ == "__main__":
    main()

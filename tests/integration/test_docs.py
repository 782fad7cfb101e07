"""The docs stand on their own: every link and every repository path they name exists,
and nothing in the repository points at files outside it."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

# README.md and every page under docs/, results/ (the experiment logs) included
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# Top-level entries a path in the docs may start with; other words in backticks
# (`model.rpe`, `log.txt`, `irpe/config.py` inside the package ...) are not checked.
REPO_DIRS = ("detr_irpe", "tools", "tests", "docs", "configs", "datasets", ".ci")
REPO_FILES = ("README.md", "setup.cfg", "pyproject.toml", "Makefile", "LICENSE",
              "constraints.txt", "hubconf.py", "ruff.toml")
# Placeholders, not paths: generated folders (run outputs, generated datasets) and
# paths with a part to fill in (<variant>, *.jpg, {name}, $VAR, OUTPUT_DIR, ...).
GENERATED = ("outputs/", "datasets/synthetic", "datasets/coco")
PLACEHOLDER = re.compile(r"[<>*{}$\[\]|]|\.\.\.")
# An all-capitals part is a name to fill in (OUTPUT_DIR/..., RUN/..., GRID.yaml), except these.
_CAPITALS = re.compile(r"(?:^|/)([A-Z][A-Z0-9_]*)(?:/|\.|$)")
REAL_CAPITALS = {"README", "LICENSE", "NOTICE", "CHANGELOG"}
# Strings that would point outside the repository (split so this file does not match).
FORBIDDEN = ("shared/" + "docs", "shared/" + "reference", "/" + "work/")

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _links(text: str) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(text)]


def _path_tokens(text: str) -> set[str]:
    """Words in inline code and code blocks that name a repository path."""
    chunks = _CODE_SPAN.findall(_FENCE.sub("", text)) + _FENCE.findall(text)
    tokens = set()
    for chunk in chunks:
        for word in re.split(r"[\s=\"'(),;]+", chunk):
            word = word.split("::", 1)[0].rstrip(".:")
            word = re.sub(r":\d+(-\d+)?$", "", word)  # file.py:120
            if word.startswith("./"):
                word = word[2:]
            first = word.split("/", 1)[0]
            if (first in REPO_DIRS and "/" in word) or word in REPO_FILES:
                tokens.add(word)
    return tokens


def _is_placeholder(path: str) -> bool:
    capitals = set(_CAPITALS.findall(path)) - REAL_CAPITALS
    return path.startswith(GENERATED) or bool(PLACEHOLDER.search(path)) or bool(capitals)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_exist(doc: Path) -> None:
    missing = []
    for target in _links(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same page
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def _in_a_clean_clone(path: str) -> bool:
    """A tracked file, a folder holding one, or a path git ignores (made by a documented
    command, as ``datasets/photos``). A file that only exists in this working tree does not
    count: CI runs on a clean clone."""
    rel = path.rstrip("/")
    real = (ROOT / rel).resolve()  # configs/ is a link to detr_irpe/configs/
    if real.is_relative_to(ROOT):
        rel = real.relative_to(ROOT).as_posix()
    tracked = _tracked_names()
    if rel in tracked or any(name.startswith(rel + "/") for name in tracked):
        return True
    # as a file or as a folder (``datasets/photos*/`` matches folders only)
    return any(subprocess.run(["git", "check-ignore", "-q", "--no-index", name],
                              cwd=ROOT).returncode == 0 for name in (rel, rel + "/"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_repository_paths_in_backticks_exist(doc: Path) -> None:
    missing = sorted(p for p in _path_tokens(doc.read_text())
                     if not _is_placeholder(p) and not _in_a_clean_clone(p))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_a_path_only_in_this_working_tree_does_not_count(tmp_path: Path) -> None:
    """What failed CI once: a doc named a folder that existed here but not in a clone."""
    assert _in_a_clean_clone("tools/train.py") and _in_a_clean_clone("configs")
    assert _in_a_clean_clone("datasets/photos")  # ignored: made by datasets/make_photos.py
    stray = ROOT / "tools" / f"untracked_{tmp_path.name}.py"
    stray.write_text("")
    try:
        assert not _in_a_clean_clone(stray.relative_to(ROOT).as_posix())
    finally:
        stray.unlink()


def test_the_path_checker_finds_paths_and_skips_placeholders() -> None:
    text = ("Run `python tools/train.py --config configs/x.yaml` and see "
            "`docs/nothing.md`, `tests/test_a.py::test_b`, `detr_irpe/config.py:12`.\n"
            "```bash\npython tools/ablate.py --set data.root=/data/coco\n```\n"
            "Not paths: `outputs/run/log.txt`, `OUTPUT_DIR/<variant>/seed<k>`, `model.rpe`, "
            "`datasets/synthetic/train`, `tools/*.py`, `RUN/ablation_status.json`.\n"
            "Real: `datasets/README.md`, `LICENSE`.\n"
            "[a link](docs/missing.md) [web](https://example.org/x.md)")
    found = {p for p in _path_tokens(text) if not _is_placeholder(p)}
    assert found == {"tools/train.py", "configs/x.yaml", "docs/nothing.md", "tests/test_a.py",
                     "detr_irpe/config.py", "tools/ablate.py", "datasets/README.md", "LICENSE"}
    assert _links(text) == ["docs/missing.md", "https://example.org/x.md"]


@functools.lru_cache(maxsize=1)
def _tracked_names() -> frozenset[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("git ls-files failed: run the tests from a git checkout")
    return frozenset(name for name in listed.decode().split("\0") if name)


def _tracked_files() -> list[Path]:
    return [ROOT / name for name in sorted(_tracked_names())]


def test_nothing_points_outside_the_repository() -> None:
    offenders = []
    for path in _tracked_files():
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary data
        for number, line in enumerate(text.splitlines(), 1):
            if any(s in line for s in FORBIDDEN):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)


# Markdown files the code writes into a run folder, not files of the repository.
GENERATED_MD = {"results.md", "sizes.md", "canvases.md"}  # the ablation runner, --sizes, --canvases
_MD_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def _md_names_in_code(text: str) -> set[str]:
    """``docs/x.md``, ``datasets/README.md``, ``irpe.md``: every Markdown file a text names."""
    return set(_MD_NAME.findall(text))


def test_markdown_files_named_in_the_code_exist() -> None:
    """Docstrings, comments and configs name docs that exist: a path from the repository
    root (``docs/model.md``), or a bare name of a file in docs/ or the root."""
    missing = []
    for path in _tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if not (rel.startswith(("detr_irpe/", "tools/")) or rel == "hubconf.py"):
            continue
        if path.suffix not in (".py", ".yaml", ".yml") or path.is_symlink():
            continue
        for name in _md_names_in_code(path.read_text()) - GENERATED_MD:
            if "/" in name:
                found = (ROOT / name).exists()
            else:
                found = (ROOT / "docs" / name).exists() or (ROOT / name).exists()
            if not found:
                missing.append(f"{rel}: {name}")
    assert not missing, "the code names Markdown files that do not exist:\n" + "\n".join(missing)


def test_the_markdown_name_finder() -> None:
    text = ('"""See docs/model.md, ``detr-recipe.md`` ("Model") and datasets/README.md.\n'
            'Writes results.md; not a name: a.mdx, x.md5."""')
    assert _md_names_in_code(text) == {"docs/model.md", "detr-recipe.md",
                                       "datasets/README.md", "results.md"}


def _console_scripts() -> dict[str, str]:
    """``{command: module}`` of setup.cfg's console scripts."""
    import configparser

    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    scripts = {}
    for line in parser["options.entry_points"]["console_scripts"].strip().splitlines():
        command, target = (part.strip() for part in line.split("=", 1))
        scripts[command] = target.split(":", 1)[0]
    return scripts


@pytest.mark.parametrize("module", sorted(set(_console_scripts().values())))
def test_every_console_script_also_runs_as_python_dash_m(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/install.md: each command is also ``python -m detr_irpe.cli.<name>``."""
    import runpy
    import sys
    import warnings

    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
        with pytest.raises(SystemExit) as stop:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def _section(text: str, heading: str) -> str:
    """The text of the Markdown section ``## heading`` (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def test_every_doc_is_in_the_readme_index() -> None:
    """The README's "Docs" table names every page under docs/ (a newcomer finds each)."""
    table = _section((ROOT / "README.md").read_text(), "Docs")
    named = set(re.findall(r"`(docs/[^`]+\.md)`", table))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert not pages - named, f"docs missing from README.md's Docs table: {sorted(pages - named)}"
    assert not named - pages, f"README.md's Docs table names missing docs: {sorted(named - pages)}"


@pytest.mark.parametrize("doc, heading", [("README.md", "Install"), ("docs/install.md", None)])
def test_the_install_lists_name_every_console_script(doc: str, heading: str | None) -> None:
    text = (ROOT / doc).read_text()
    if heading is not None:
        text = _section(text, heading)
    named = set(re.findall(r"`(detr-irpe-[a-z-]+)`", text))
    missing = sorted(set(_console_scripts()) - named)
    assert not missing, f"{doc} does not name the console scripts {missing} (setup.cfg)"


def test_the_section_reader() -> None:
    text = "# T\n## A\nx `docs/a.md`\n### sub\ny\n## B\nz\n"
    assert _section(text, "A") == "x `docs/a.md`\n### sub\ny\n"
    assert _section(text, "B") == "z\n"

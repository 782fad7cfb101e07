"""The package as a user installs it: a wheel built from the sources (``pip install .``,
not editable) into a fresh virtual environment, used from a folder outside the
repository. The environment reuses this interpreter's installed torch and other
dependencies through a ``.pth`` file, so nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

import detr_irpe
from detr_irpe.config import CONFIG_DIR

# Every console script setup.cfg declares, and the module whose main() it calls.
# train and eval (the tools torchrun starts) end through run (cli.args.run_program)
CONSOLE_SCRIPTS = {
    f"detr-irpe-{name}": f"detr_irpe.cli.{name}:{'run' if name in ('train', 'eval') else 'main'}"
    for name in ("train", "eval", "predict", "visualize", "export", "convert", "ablate",
                 "submit", "benchmark", "synthetic", "data")
}
# What a wheel is built from (the same files as a source distribution holds).
_SOURCES = ("detr_irpe", "setup.cfg", "pyproject.toml", "README.md", "LICENSE")


def _run(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_NO_INDEX"] = "1"  # never the network
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))} exited {result.returncode}:\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the sources (the build writes nothing into the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in _SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.is_file():
            shutil.copy2(path, src / name)
    out = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(out), str(src)], cwd=tmp)
    (built,) = out.glob("detr_irpe-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bin/`` of a fresh virtual environment with the wheel installed (not editable)."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=env_dir).stdout.strip())
    # This interpreter's packages (torch, ...) after the environment's own: the wheel's
    # detr_irpe comes first, and the editable install's hook here is not run (a directory
    # added by a .pth file is not a site directory, so its own .pth files are skipped).
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "outer_site_packages.pth").write_text("\n".join(sorted(outer)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=env_dir)
    return env_dir / "bin"


def test_wheel_ships_every_config_and_grid(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entries = archive.read(entry_points).decode()
    shipped = {f"detr_irpe/configs/{p.relative_to(CONFIG_DIR).as_posix()}"
               for p in CONFIG_DIR.rglob("*.yaml")}
    assert any("/ablations/" in name for name in shipped)
    assert shipped <= names, sorted(shipped - names)
    assert "detr_irpe/cli/common.py" in names
    for script, target in CONSOLE_SCRIPTS.items():
        assert f"{script} = {target}" in entries
    # one version string: setup.cfg reads the package's own
    assert wheel.name.startswith(f"detr_irpe-{detr_irpe.__version__}-")


@pytest.mark.slow  # a fresh environment and three interpreters importing torch
def test_installed_package_runs_from_any_folder(installed: Path, tmp_path: Path) -> None:
    """Not editable: the package, its configs and grids come from the environment, and
    the console script answers from a folder that is not the repository."""
    python = installed / "python"
    probe = _run([str(python), "-c",
                  "import detr_irpe, detr_irpe.config as c\n"
                  "print(detr_irpe.__file__)\n"
                  "print(c.load_config('detr_r50_irpe').model.rpe)\n"
                  "print((c.CONFIG_DIR / 'ablations' / 'demo_methods.yaml').is_file())"],
                 cwd=tmp_path)
    location, rpe, grid_found = probe.stdout.split()
    assert Path(location).is_relative_to(installed.parent), location
    assert not Path(location).is_relative_to(ROOT)
    assert rpe == "rpe-2.0-product-ctx-1-k" and grid_found == "True"
    help_text = _run([str(installed / "detr-irpe-train"), "--help"], cwd=tmp_path).stdout
    assert "--config" in help_text and "--set" in help_text
    # Every console script is on PATH and resolves to a main() in the installed package.
    assert all((installed / script).is_file() for script in CONSOLE_SCRIPTS)
    loaded = _run([str(python), "-c",
                   "from importlib.metadata import entry_points\n"
                   "for ep in entry_points(group='console_scripts'):\n"
                   "    if ep.name.startswith('detr-irpe-'):\n"
                   "        print(ep.name, ep.load().__module__)"], cwd=tmp_path).stdout
    assert sorted(loaded.split("\n")[:-1]) == sorted(
        f"{script} {target.split(':')[0]}" for script, target in CONSOLE_SCRIPTS.items())


# Building, installing and one epoch together take about a minute on 2 busy cores: the
# default run keeps the build, install and --help checks above.
@pytest.mark.slow
def test_console_script_trains_the_tiny_config(installed: Path, tiny_dataset: Path,
                                               tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run([str(installed / "detr-irpe-train"), "--config", "synthetic_tiny", "--set",
          f"data.root={tiny_dataset}", "train.epochs=1", f"train.output_dir={out}",
          "--no-progress"], cwd=tmp_path, timeout=600)
    assert (out / "checkpoint_last.pth").is_file()
    log = (out / "log.txt").read_text().splitlines()
    assert len(log) == 1 and '"epoch": 0' in log[0]


# ----------------------------------------------------------------------------- dependencies
# An API the package calls -> (distribution, first release that has it), from the
# libraries' documentation and release notes (docs/install.md lists the same).
API_SINCE = {
    "torch.compiler.is_exporting": ("torch", "2.7"),
    "torch.serialization.safe_globals": ("torch", "2.5"),
    "torch.amp.GradScaler": ("torch", "2.3"),
    "device_id=": ("torch", "2.3"),  # init_process_group(device_id=...)
    "ImageFont.load_default(size=": ("pillow", "10.1"),
}
# Broken with NumPy 2 before this release.
KNOWN_BAD = {"pycocotools": "2.0.8"}


def _requirements() -> dict[str, list]:
    import configparser

    from packaging.requirements import Requirement

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].strip().splitlines()
    out: dict[str, list] = {"core": [Requirement(x) for x in lines if x.strip()]}
    for extra, text in cfg["options.extras_require"].items():
        out[extra] = [Requirement(x) for x in text.strip().splitlines() if x.strip()]
    return out


def _floor(requirement) -> str:
    floors = [s.version for s in requirement.specifier if s.operator == ">="]
    assert floors, f"{requirement} has no >= floor"
    return floors[0]


def test_floors_cover_the_apis_the_package_calls() -> None:
    from packaging.version import Version

    core = {r.name.lower(): r for r in _requirements()["core"]}
    source = "\n".join(p.read_text() for p in (ROOT / "detr_irpe").rglob("*.py"))
    for api, (dist, since) in API_SINCE.items():
        if api in source:
            assert Version(_floor(core[dist])) >= Version(since), (api, str(core[dist]))
    for dist, good in KNOWN_BAD.items():
        assert Version(_floor(core[dist])) >= Version(good), str(core[dist])
    # torchvision's floor is the release made for torch's floor (they ship in pairs).
    torch_minor = Version(_floor(core["torch"])).minor
    assert Version(_floor(core["torchvision"])) >= Version(f"0.{torch_minor + 15}")


def test_constraints_pin_every_dependency_within_its_floor() -> None:
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    requirements = _requirements()
    # torch and torchvision depend on the machine's CUDA: TORCH_PINS / TORCH_INDEX, not here.
    torch_family = {"torch", "torchvision"}
    for group in ("core", "test"):
        for requirement in requirements[group]:
            name = canonicalize_name(requirement.name)
            if name in torch_family:
                assert name not in pins
                continue
            assert name in pins, f"{name} ({group}) is not pinned in constraints.txt"
            assert pins[name] in requirement.specifier, (str(requirement), str(pins[name]))
    makefile = (ROOT / "Makefile").read_text()
    assert "-c $(CONSTRAINTS)" in makefile and "--index-url $(TORCH_INDEX)" in makefile
    assert "://" not in makefile  # no host named: the index is the user's to give


def test_no_repository_file_is_hidden_by_gitignore() -> None:
    """A clean clone has what the tests read: no data file, config or source under the
    repository's own folders may be ignored by git (a ``*.pt`` rule once hid two reference
    files, and CI failed where this checkout passed)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--",
         "detr_irpe", "tests", "configs", "tools", "docs"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    caches = ("__pycache__/", ".pyc", ".pytest_cache/", ".ruff_cache/")
    hidden = [path for path in listed if not any(part in path for part in caches)]
    assert not hidden, f"files ignored by .gitignore that a clean clone would lack: {hidden}"

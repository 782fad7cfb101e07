"""Pascal VOC XML datasets: where their splits are, and what is wrong with their files.

One XML file ``<stem>.xml`` per image ``<stem>.<ext>``: ``<size>`` (width, height) and an
``<object>`` per box with ``<name>`` and ``<bndbox>`` (``xmin ymin xmax ymax``, 1-based
inclusive pixel indices as the VOC devkit writes them).

The layouts found (:func:`find_voc_splits`):

- the VOC devkit, and CVAT's / Label Studio's "Pascal VOC" exports: ``Annotations/``,
  ``JPEGImages/`` and ``ImageSets/Main/<split>.txt`` (one image stem a line; ``train``,
  ``val``, ``trainval``, ``test``, CVAT's ``default``); without the lists, one split;
- LabelImg: the XML files next to the images, in one folder.

:func:`check_voc_split` reads every XML file once and lists each bad case on one line:
an annotation file without an image, a file that is not XML, an object without a name
or a box, a class not among ``--names``, a box outside the image (by its ``<size>``) or
with its corners swapped; with ``fix`` it writes corrected copies instead. Files are
read through :mod:`.guard` (inside the source, regular, bounded) and an XML file that
declares entities is refused (as supervision's reader, defusedxml, refuses it), on one line.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detr_irpe.data.convert.guard import (
    MAX_LIST_BYTES,
    MAX_XML_BYTES,
    SourceFiles,
    Unreadable,
    decode_text,
    excerpt,
)
from detr_irpe.data.convert.problems import Problems
from detr_irpe.data.convert.yolo import (
    SPLIT_NAMES,
    ImageChecks,
    SourceSplit,
    check_image,
    image_files,
)
from detr_irpe.errors import DatasetError

__all__ = ["VocSource", "check_voc_split", "find_voc_splits"]

# A box may reach this many pixels past the image (by <size>) before it is a problem.
VOC_TOLERANCE = 1.0
# ImageSets/Main lists, in the order they are taken (trainval only without train).
SPLIT_LISTS = ("train", "val", "test", "trainval", "default")


@dataclass(frozen=True)
class VocSource:
    """A VOC dataset: its splits (``images``: image folder, ``labels``: XML folder) and,
    per split, the image stems it keeps and the list file naming them (None: every image
    of the folder)."""

    splits: tuple[SourceSplit, ...]
    stems: tuple[frozenset[str] | None, ...]
    lists: tuple[Path | None, ...] = ()


def _list_stems(path: Path, files: SourceFiles) -> frozenset[str]:
    # "stem" or, in the devkit's per-class lists, "stem  1"
    try:
        text = decode_text(files.read(path, MAX_LIST_BYTES, "image list"))
    except Unreadable as err:
        raise DatasetError(f"{path}: {err}") from None
    return frozenset(line.split()[0] for line in text.splitlines() if line.strip())


def find_voc_splits(source: str | Path, images: str | Path | None = None,
                    labels: str | Path | None = None, *,
                    files: SourceFiles | None = None) -> VocSource:
    """The splits of the VOC dataset in ``source`` (layouts: module docstring);
    ``images`` and ``labels`` (one split's folders) override what is found. ``files``:
    which files may be read (default: those inside ``source``, ``images``, ``labels``)."""
    source = Path(source)
    if files is None:
        files = SourceFiles(source, (images, labels))
    if images is not None:
        image_dir = Path(images)
        split = SourceSplit("train", image_dir, Path(labels) if labels else image_dir)
        return VocSource((split,), (None,))
    if not source.is_dir():
        raise DatasetError(f"{source} is not a folder")
    annotations, jpegs = source / "Annotations", source / "JPEGImages"
    if annotations.is_dir():
        image_dir = jpegs if jpegs.is_dir() else source / "images"
        if not image_dir.is_dir():
            raise DatasetError(f"{source}: Annotations/ without JPEGImages/ (or images/); give "
                               "the image folder with --images DIR")
        files.check_folder(annotations, "the annotation folder")
        files.check_folder(image_dir, "the image folder")
        lists = source / "ImageSets" / "Main"
        found: dict[str, Path] = {}
        for name in SPLIT_LISTS:
            listed = lists / f"{name}.txt"
            ours = SPLIT_NAMES.get(name, "train")
            if listed.is_file() and ours not in found:
                found[ours] = listed
        if not found:
            return VocSource((SourceSplit("train", image_dir, annotations),), (None,))
        return VocSource(tuple(SourceSplit(n, image_dir, annotations) for n in found),
                         tuple(_list_stems(p, files) for p in found.values()),
                         tuple(found.values()))
    if any(p.suffix == ".xml" for p in source.iterdir()):
        return VocSource((SourceSplit("train", source, source),), (None,))
    raise DatasetError(f"{source}: no Pascal VOC layout found (Annotations/ + JPEGImages/, "
                       "or XML files next to the images); give --images DIR --labels DIR")


def _number(obj: ET.Element, tag: str) -> float | None:
    node = obj.find(tag)
    try:
        value = float(node.text) if node is not None and node.text else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _defusedxml() -> Any:
    try:
        # the formats extra (setup.cfg): supervision reads VOC files with it as well
        import defusedxml
        import defusedxml.ElementTree
    except ImportError:
        raise DatasetError("reading Pascal VOC files needs the defusedxml package: pip "
                           "install 'detr_irpe[formats]'") from None
    return defusedxml


def _parse_xml(xml: Path, files: SourceFiles) -> ET.Element:
    """The root element of ``xml``; :class:`Unreadable` saying why not (never its text)."""
    defused = _defusedxml()
    data = files.read(xml, MAX_XML_BYTES, "VOC annotation file")
    try:
        return defused.ElementTree.fromstring(data)
    except ET.ParseError as err:
        raise Unreadable(f"not a readable XML file ({err})") from None
    except defused.DefusedXmlException as err:
        name = getattr(err, "name", None)
        shown = f" {excerpt(name)}" if name else ""
        raise Unreadable(f"declares an XML entity{shown} (<!ENTITY>): refused, since an "
                         "entity can expand without bound or read another file") from None
    except RecursionError:
        raise Unreadable("XML nested too deep to read") from None


def check_voc_split(split: SourceSplit, stems: frozenset[str] | None, problems: Problems,
                    names: list[str] | None = None, fix_dir: Path | None = None,
                    listed_in: Path | None = None, *, checks: ImageChecks | None = None
                    ) -> list[str]:
    """Check every image and XML file of ``split`` (of the images in ``stems``, which
    ``listed_in`` names); each bad case is added to ``problems``. Returns the class names
    found, sorted (``names`` when given).

    ``fix_dir``: write each XML file there, with the bad objects dropped and boxes clipped
    to the image (what ``--fix`` converts). ``checks``: which files may be read, the
    images' pixel limit, and the set the images refused are added to
    (:class:`~.yolo.ImageChecks`).
    """
    checks = checks or ImageChecks()
    files = checks.files if checks.files is not None else SourceFiles(
        split.labels, follow_links_outside=True)
    images: dict[str, Path] = {}
    for path in image_files(split.images):
        if stems is not None and path.stem not in stems:
            continue
        problem = check_image(path, files, checks.max_pixels)
        if problem is None:
            images[path.stem] = path
            continue
        problems.add(path, problem)
        if checks.rejected is not None:
            checks.rejected.add(path)
    refused = {p.stem for p in checks.rejected or ()}
    found: set[str] = set()
    for xml in sorted(split.labels.glob("*.xml")):
        if stems is not None and xml.stem not in stems:
            continue
        if xml.stem not in images:
            if xml.stem not in refused:
                problems.add(xml, f"annotation file without an image (no {xml.stem}.jpg / "
                             f".png / ... in {split.images})")
            continue
        try:
            root = _parse_xml(xml, files)
        except Unreadable as err:
            problems.add(xml, str(err))
            continue
        tree = ET.ElementTree(root)
        size = root.find("size")
        width = _number(size, "width") if size is not None else None
        height = _number(size, "height") if size is not None else None
        for k, obj in enumerate(root.findall("object"), 1):
            what = _check_object(obj, width, height, names)
            name = (obj.findtext("name") or "").strip()
            if what is None:
                found.add(name)
                continue
            problems.add(f"{xml} object {k}", what)
            if fix_dir is None:
                continue
            if (names is None or name in names) and _clip(obj, width, height):
                found.add(name)
            else:
                root.remove(obj)
        if fix_dir is not None:
            fix_dir.mkdir(parents=True, exist_ok=True)
            tree.write(fix_dir / xml.name)
    for stem in sorted(stems or ()):
        if stem not in images and stem not in refused:
            problems.add(listed_in or split.labels, f"{stem!r} has no image in {split.images}")
    return list(names) if names is not None else sorted(found)


def _check_object(obj: ET.Element, width: float | None, height: float | None,
                  names: list[str] | None) -> str | None:
    name = (obj.findtext("name") or "").strip()
    if not name:
        return "object without a <name>"
    if names is not None and name not in names:
        return (f"class {excerpt(name)} is not among the names "
                f"({', '.join(excerpt(n) for n in names[:10])})")
    box = obj.find("bndbox")
    if box is None:
        return "object without a <bndbox>"
    values = [_number(box, t) for t in ("xmin", "ymin", "xmax", "ymax")]
    if any(v is None for v in values):
        return "<bndbox> needs xmin, ymin, xmax, ymax as numbers"
    x1, y1, x2, y2 = values
    if x2 < x1 or y2 < y1:
        return f"box corners swapped (xmin {x1:g}, xmax {x2:g}, ymin {y1:g}, ymax {y2:g})"
    tol = VOC_TOLERANCE
    if x1 < 1 - tol or y1 < 1 - tol or (width and x2 > width + tol) or (
            height and y2 > height + tol):
        shown = [f"{v:g}" if v else "?" for v in (width, height)]
        return (f"box ({x1:g}, {y1:g})-({x2:g}, {y2:g}) reaches outside the "
                f"{shown[0]} x {shown[1]} image")
    return None


def _clip(obj: ET.Element, width: float | None, height: float | None) -> bool:
    """Clip an object's box to the image in place; False when it cannot be kept."""
    box = obj.find("bndbox")
    name = (obj.findtext("name") or "").strip()
    values = [_number(box, t) for t in ("xmin", "ymin", "xmax", "ymax")] if box is not None else []
    if not name or len(values) != 4 or any(v is None for v in values):
        return False
    x1, y1 = max(min(values[0], values[2]), 1.0), max(min(values[1], values[3]), 1.0)
    x2, y2 = max(values[0], values[2]), max(values[1], values[3])
    x2, y2 = min(x2, width or x2), min(y2, height or y2)
    if x2 <= x1 or y2 <= y1:
        return False
    for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), (x1, y1, x2, y2)):
        box.find(tag).text = f"{value:g}"
    return True

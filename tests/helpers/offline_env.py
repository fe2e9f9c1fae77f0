"""Stand-ins for a bare GPU box in tests: a venv that sees only some of this interpreter's installed
distributions (symlinked, not copied: seconds, no network), and wheels repacked from installed ones to
serve as a local wheel folder."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, metadata.Distribution]:
    """This interpreter's distributions by normalized name (the project itself left out)."""
    found = {normalize(d.metadata["Name"]): d for d in metadata.distributions()}
    found.pop("aiayn", None)
    return found


def closure(roots: Iterable[str]) -> set[str]:
    """`roots` and everything they need, by their installed metadata (markers for this interpreter,
    extras not followed): the packages a GPU image that brings `roots` holds."""
    dists, todo, seen = installed(), [normalize(r) for r in roots], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in dists:
            continue
        seen.add(name)
        for line in dists[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalize(requirement.name))
    return seen


def image_venv(root: Path, names: set[str]) -> Path:
    """A venv at root/venv that sees the installed distributions `names` (pip among them if the image has
    it) through a `.pth` line to root/image, a folder of symlinks to their top-level files; returns its
    python. The venv itself has no pip: installing pip into it (ensurepip) took 6.8 s, linking it none."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    image = root / "image"
    image.mkdir()
    dists = installed()
    for name in sorted(names):
        for path in dists[name].files or []:
            top = path.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or (image / top).exists():
                continue
            source = Path(str(dists[name].locate_file(top)))
            if source.exists():
                (image / top).symlink_to(source)
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "gpu_image.pth").write_text(f"{image}\n")
    return python


def repack_wheel(name: str, folder: Path) -> Path:
    """The installed distribution `name` as a wheel file in `folder` (its files and metadata, a fresh
    RECORD), tagged as its WHEEL file says: what a local wheel folder would hold."""
    dist = installed()[normalize(name)]
    lines = (dist.read_text("WHEEL") or "").splitlines()
    tag = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Tag:"))
    wheel = folder / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl"
    record_name, rows = None, []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in dist.files or []:
            if path.parts[0] == ".." or "__pycache__" in path.parts:
                continue
            if path.name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                record_name = str(path.parent / "RECORD") if path.name == "RECORD" else record_name
                continue
            data = Path(str(dist.locate_file(path))).read_bytes()
            archive.writestr(str(path), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{path},sha256={digest},{len(data)}")
        assert record_name, f"{name}: no RECORD"
        archive.writestr(record_name, "\n".join([*rows, f"{record_name},,"]) + "\n")
    return wheel

"""Build an offline bundle: this repository and the wheels a target machine lacks, with a `run.sh` that
installs them without network and runs a command in the bundled repository.

    scripts/offline_bundle.sh OUT_DIR [--python-version X.Y] [--have FREEZE_FILE] [--extras test,bench]

Run on a machine that reaches a package index (or with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR, a local wheel
folder); the target (a GPU node without network) needs only its `python` on PATH and runs
`OUT_DIR/run.sh 'COMMAND'` from anywhere. The target's packages (`--have`, its `pip freeze`) are never
bundled: a GPU image's torch is built for its CUDA and must stay the one it has. What it lacks is resolved
by pip against a stand-in environment that holds the target's packages as metadata only, so pip chooses
versions that fit what is there:

1. pip resolves the project's requirements for the running interpreter (pip's own rules and markers);
   a requirement published only as a source archive is built into a wheel here (it must be pure Python
   when the target's Python differs);
2. for another Python version (or `--platform`), pip resolves again for the target, binary wheels only,
   with the versions of step 1 as constraints (so it cannot fall back to old releases that had wheels);
3. `pip download --no-deps` fetches the wheels of the result, minus what the target has.

Every failure is one `error:` line on stderr and exit status 1; an existing OUT_DIR is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[1]
PROJECT = "aiayn"
PURE_TAGS = ("py3-none-any", "py2.py3-none-any")
RUN_SH = r"""#!/usr/bin/env bash
# Runs COMMAND in the bundled repository with the bundled wheels, without network:
#   run.sh 'python train.py --cfg job'
# The first call installs the wheels into site-packages/ here (pip --no-index --no-deps --target); every
# call puts the repository and them on PYTHONPATH and runs COMMAND from the repository's root.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ $# -ne 1 ]; then
    echo "usage: $0 'COMMAND'   (runs COMMAND in $HERE/repo)" >&2
    exit 2
fi
WANT=$(cat "$HERE/PYTHON_VERSION")
if ! command -v python >/dev/null && command -v python3 >/dev/null; then  # images with python3 only
    mkdir -p "$HERE/bin" && ln -sf "$(command -v python3)" "$HERE/bin/python"
    export PATH="$HERE/bin:$PATH"
fi
HAVE=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null) || {
    echo "error: no 'python' on PATH; this bundle is for Python $WANT" >&2
    exit 1
}
if [ "$HAVE" != "$WANT" ]; then
    echo "error: this bundle's wheels are for Python $WANT, 'python' on PATH is $HAVE" \
         "($(command -v python)): build it again with --python-version $HAVE" >&2
    exit 1
fi
SITE=$HERE/site-packages
if [ ! -f "$SITE/.installed" ]; then
    rm -rf "$SITE.partial"
    shopt -s nullglob
    WHEELS=("$HERE"/wheels/*.whl)
    if [ ${#WHEELS[@]} -gt 0 ]; then
        python -m pip install --quiet --no-index --no-deps --no-cache-dir --disable-pip-version-check \
            --target "$SITE.partial" "${WHEELS[@]}" >&2
    fi
    mkdir -p "$SITE.partial"
    touch "$SITE.partial/.installed"
    rm -rf "$SITE"
    mv "$SITE.partial" "$SITE"  # whole or absent: an interrupted install starts again next time
fi
export PYTHONPATH="$HERE/repo:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
cd "$HERE/repo"
exec bash -c "$1"
"""


class BundleError(Exception):
    """A user error: printed as one `error:` line."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one `error:` line too (BundleError), with the usage on the same line."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())
        raise BundleError(f"{message} ({usage})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="offline_bundle.sh", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the bundle's folder (must not exist, or be empty)")
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    parser.add_argument("--python-version", default=running, help=f"the target's X.Y (default {running})")
    parser.add_argument("--have", type=Path, help="the target's `pip freeze`: never bundled")
    parser.add_argument("--extras", default="test", help="the project's extras to bundle too (default test)")
    parser.add_argument("--platform", action="append", default=[], help="pip --platform tag(s) of the target")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        raise BundleError(f"--python-version: expected X.Y such as 3.12, got {args.python_version!r}")
    return args


def read_have(path: Path | None) -> dict[str, str | None]:
    """{normalized name: version or None} from a `pip freeze` file (`name==v`, `name @ url`, `-e ..#egg=`)."""
    if path is None:
        return {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BundleError(f"--have {path}: cannot read it ({error})") from None
    have: dict[str, str | None] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("-e") else raw.strip()
        if not line:
            continue
        egg = re.search(r"#egg=([A-Za-z0-9._-]+)", line)
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+)|@\s*\S+)?\s*(?:;.*)?", line)
        if egg:
            have[normalize(egg.group(1))] = None
        elif match:
            have[normalize(match.group(1))] = match.group(2)
        else:
            raise BundleError(
                f"--have {path}:{number}: expected a `pip freeze` line (name==version), got {raw!r}"
            )
    return have


def requirements(extras: str) -> list[str]:
    """The project's dependencies and those of `extras` (self-references such as aiayn[export] expanded)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise BundleError("building a bundle needs Python 3.11 or newer here (tomllib)") from None
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    wanted, seen, out = [e for e in extras.split(",") if e], set(), list(project["dependencies"])
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise BundleError(
                f"--extras: no extra {extra!r} in pyproject.toml (there are {sorted(optional)})"
            )
        seen.add(extra)
        for requirement in optional[extra]:
            own = re.fullmatch(rf"{PROJECT}\[([^\]]+)\]", requirement.replace(" ", ""))
            if own:
                wanted.extend(own.group(1).split(","))
            else:
                out.append(requirement)
    return out


def stand_in(root: Path, have: dict[str, str | None]) -> Path:
    """A venv without pip whose site-packages holds the target's packages as metadata only; pip resolves
    against it (`pip --python`) and counts them as installed."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    for name, version in have.items():
        version = version or "0+unknown"  # no version given (`name @ url`): bundled never anyway
        info = Path(site) / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return python


def pip(*args: str, what: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [
            line for line in done.stderr.splitlines() if line.startswith("ERROR")
        ] or done.stderr.splitlines()
        raise BundleError(f"{what}: pip failed: {' '.join(lines[-2:]).strip() or 'no message'}")
    return done


def resolve(python: Path, reqs: list[str], report: Path, extra: list[str], what: str) -> list[dict]:
    """pip's resolution of `reqs` against the stand-in environment: [{name, version, url}]."""
    pip(
        "--python",
        str(python),
        "install",
        "--dry-run",
        "--quiet",
        "--report",
        str(report),
        *extra,
        *reqs,
        what=what,
    )
    items = json.loads(report.read_text())["install"]
    return [
        {
            "name": normalize(i["metadata"]["name"]),
            "version": i["metadata"]["version"],
            "url": i["download_info"]["url"],
        }
        for i in items
    ]


def check_pip() -> None:
    import pip as pip_module

    major, minor = (int(x) for x in pip_module.__version__.split(".")[:2])
    if (major, minor) < (24, 1):
        raise BundleError(
            f"pip {pip_module.__version__} is too old to resolve for another environment (needs 24.1): "
            f"{sys.executable} -m pip install --upgrade pip"
        )


def remove_contents(out: Path, created: bool) -> None:
    """What a failed build wrote: the whole folder if the build made it, else everything inside."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for path in out.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def copy_repository(out: Path) -> int:
    """The tracked files as they are in the working tree (no data, no build output); returns the count."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=False)
    if listed.returncode != 0:
        raise BundleError(f"{REPO} is not a git checkout: the bundle copies its tracked files")
    files = [f for f in listed.stdout.decode().split("\0") if f and (REPO / f).is_file()]
    for name in files:
        target = out / "repo" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return len(files)


def build(args: argparse.Namespace, work: Path, out: Path) -> list[Path]:
    """The wheels of every requirement the target lacks, in out/wheels (see the top)."""
    have = read_have(args.have)  # a missing freeze file is the first thing to report
    check_pip()
    reqs = requirements(args.extras)
    python = stand_in(work / "env", have)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    first = [i for i in resolve(python, reqs, work / "r1.json", [], "resolving") if i["name"] not in have]
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    cross = args.python_version != running or bool(args.platform)
    sdists = [i for i in first if not i["url"].endswith(".whl")]
    for item in sdists if cross else first:  # same target: pip wheel copies wheels and builds the rest
        pip("wheel", "--quiet", "--no-deps", "-w", str(wheels), f"{item['name']}=={item['version']}",
            what=f"{item['name']} {item['version']}")  # fmt: skip
    if not cross:
        return sorted(wheels.glob("*.whl"))
    for built in wheels.glob("*.whl"):
        if not built.name.endswith(tuple(f"-{tag}.whl" for tag in PURE_TAGS)):
            raise BundleError(f"{built.name}: no wheel for Python {args.python_version} and not pure Python")
    (work / "pins.txt").write_text("".join(f"{i['name']}=={i['version']}\n" for i in first))
    target = ["--python-version", args.python_version, "--only-binary=:all:", "--find-links", str(wheels)]
    target += [f"--platform={tag}" for tag in args.platform]
    second = resolve(python, reqs, work / "r2.json", [*target, "-c", str(work / "pins.txt")],
                     f"resolving for Python {args.python_version}")  # fmt: skip
    missing = [i for i in second if i["name"] not in have and not i["url"].startswith(wheels.as_uri())]
    if missing:
        pins = [f"{i['name']}=={i['version']}" for i in missing]
        what = f"downloading for Python {args.python_version}"
        pip("download", "--quiet", "--no-deps", "-d", str(wheels), *target, *pins, what=what)
    return sorted(wheels.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        out = args.out_dir.resolve()
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise BundleError(
                f"{args.out_dir}: exists and is not an empty folder; the bundle needs a new one"
            )
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="bundle-") as tmp:
            try:
                wheels = build(args, Path(tmp), out)
                files = copy_repository(out)
            except BaseException:  # no half bundle left behind
                remove_contents(out, created)
                raise
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    (out / "PYTHON_VERSION").write_text(args.python_version + "\n")
    (out / "run.sh").write_text(RUN_SH)
    (out / "run.sh").chmod(0o755)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    listing = "".join(f"  {w.name}  {w.stat().st_size / 2**20:.1f} MB\n" for w in wheels)
    (out / "WHEELS.txt").write_text(listing)
    print(f"{out}: {files} repository files, {len(wheels)} wheels for Python {args.python_version}, "
          f"{size / 2**20:.1f} MB in all\n{listing}on the target: {out.name}/run.sh 'COMMAND'")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())

"""scripts/offline_bundle.py without network: its first checks (bad arguments and an unreadable `--have`
file are one `error:` line each, the latter reported before pip's version is looked at), and its resolution
with pip stood in for (the same Python: one resolution, wheels built here; another Python or platform: a
second resolution for the target, pinned to the first; the target's packages never bundled)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle() -> ModuleType:
    spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


@pytest.mark.parametrize("argv", [[], ["a", "b"], ["out", "--bogus"], ["out", "--python-version"]])
def test_bad_arguments_are_one_error_line(
    bundle: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert bundle.main(argv) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "usage: offline_bundle.sh" in lines[0]


def test_a_missing_freeze_file_is_reported_before_pip_s_version(
    bundle: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pip", types.SimpleNamespace(__version__="23.0"))  # too old
    out = tmp_path / "bundle"
    assert bundle.main([str(out), "--have", str(tmp_path / "missing.txt")]) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --have ") and "cannot read it" in lines[0]
    assert not out.exists()  # the folder it made is gone again
    (tmp_path / "freeze.txt").write_text("torch==2.11.0\n")
    assert bundle.main([str(out), "--have", str(tmp_path / "freeze.txt")]) == 1
    assert "pip 23.0 is too old" in _error_lines(capsys)[0]


# --- the resolution (pip stands in: no network, no venv) ----------------------------------------------

RUNNING = f"{sys.version_info[0]}.{sys.version_info[1]}"
OTHER = "3.11" if RUNNING != "3.11" else "3.12"


class _FakePip:
    """`offline_bundle.pip` without pip: `install --dry-run --report` writes a resolution (the second one,
    for another Python, finds the wheels built from source archives in the --find-links folder), `wheel`
    and `download` write empty wheel files; every call is kept with the pins file it was given."""

    def __init__(self, sdists: dict[str, str]) -> None:
        self.sdists = sdists  # name -> the tags of the wheel `pip wheel` builds from its source archive
        self.calls: list[tuple[str, ...]] = []
        self.pins: list[str] = []

    def resolution(self, args: tuple[str, ...]) -> list[dict]:
        wheels = args[args.index("--find-links") + 1] if "--find-links" in args else None
        tag = f"cp{OTHER.replace('.', '')}" if wheels else f"cp{RUNNING.replace('.', '')}"
        items = []
        released = [("torch", "2.5.0"), ("numpy", "2.1.0"), ("lightning", "2.6.0")]
        for name, version in released + [(name, "1.0") for name in self.sdists]:
            if name in self.sdists:
                url = (
                    f"{Path(wheels).as_uri()}/{name}-{version}-{self.sdists[name]}.whl"
                    if wheels
                    else f"https://files.example/{name}-{version}.tar.gz"
                )
            else:
                url = f"https://files.example/{name}-{version}-{tag}-{tag}-manylinux_2_17_x86_64.whl"
            items.append({"metadata": {"name": name, "version": version}, "download_info": {"url": url}})
        return items

    def __call__(self, *args: str, what: str) -> None:
        self.calls.append(args)
        if args[0] == "--python" and "--dry-run" in args:
            if "-c" in args:
                self.pins = Path(args[args.index("-c") + 1]).read_text().splitlines()
            report = Path(args[args.index("--report") + 1])
            report.write_text(json.dumps({"install": self.resolution(args)}))
        elif args[0] == "wheel":
            folder, (name, version) = Path(args[args.index("-w") + 1]), args[-1].split("==")
            tags = self.sdists.get(name, f"cp{RUNNING.replace('.', '')}-cp{RUNNING.replace('.', '')}-linux")
            (folder / f"{name}-{version}-{tags}.whl").write_bytes(b"")
        elif args[0] == "download":
            folder = Path(args[args.index("-d") + 1])
            for pin in (a for a in args if "==" in a):
                name, version = pin.split("==")
                (folder / f"{name}-{version}-cp{OTHER.replace('.', '')}-manylinux.whl").write_bytes(b"")

    def of(self, command: str) -> list[tuple[str, ...]]:
        return [
            call
            for call in self.calls
            if call[0] == command or (command == "resolve" and "--dry-run" in call)
        ]


def _build(
    bundle: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sdists: dict[str, str], *argv: str
) -> tuple[_FakePip, list[str]]:
    """`build` for `argv` with the fake pip, a target that has torch; returns the pip and the wheel names."""
    fake = _FakePip(sdists)
    tmp_path.mkdir(exist_ok=True)
    monkeypatch.setattr(bundle, "pip", fake)
    monkeypatch.setattr(bundle, "stand_in", lambda root, have: root / "bin" / "python")
    monkeypatch.setitem(sys.modules, "pip", types.SimpleNamespace(__version__="25.0"))
    (tmp_path / "freeze.txt").write_text("torch==2.5.0\n")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    args = bundle.parse_args([str(out), "--have", str(tmp_path / "freeze.txt"), *argv])
    return fake, [wheel.name for wheel in bundle.build(args, work, out)]


def test_a_bundle_for_the_running_python_builds_every_missing_wheel_here(
    bundle: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, wheels = _build(bundle, tmp_path, monkeypatch, {"sacrebleu": "py3-none-any"})
    assert len(fake.of("resolve")) == 1 and not fake.of("download")  # one resolution: pip's own rules
    assert sorted(call[-1] for call in fake.of("wheel")) == [
        "lightning==2.6.0",
        "numpy==2.1.0",
        "sacrebleu==1.0",
    ]
    assert not any(name.startswith("torch") for name in wheels) and len(wheels) == 3  # the target has it


@pytest.mark.parametrize(
    "argv", [["--python-version", OTHER], ["--platform", "manylinux_2_28_x86_64"]], ids=["python", "platform"]
)
def test_a_cross_bundle_resolves_again_for_the_target_pinned_to_the_first_resolution(
    bundle: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """Another Python (or platform): only the source archives are built here (pure Python); pip resolves
    again for the target, binary wheels only, pinned to the first resolution's versions; the wheels it
    lacks (not the target's, not the ones built) are downloaded for the target."""
    fake, wheels = _build(bundle, tmp_path, monkeypatch, {"sacrebleu": "py3-none-any"}, *argv)
    assert [call[-1] for call in fake.of("wheel")] == ["sacrebleu==1.0"]
    first, second = fake.of("resolve")
    target = argv if argv[0] == "--python-version" else ["--python-version", RUNNING, f"--platform={argv[1]}"]
    assert "--only-binary=:all:" in second and "--only-binary=:all:" not in first
    assert all(a in second for a in target) and "--python-version" not in first
    assert sorted(fake.pins) == ["lightning==2.6.0", "numpy==2.1.0", "sacrebleu==1.0"]  # torch: the target's
    (download,) = fake.of("download")
    assert sorted(a for a in download if "==" in a) == ["lightning==2.6.0", "numpy==2.1.0"]
    assert all(a in download for a in target) and "--only-binary=:all:" in download
    assert len(wheels) == 3 and not any(name.startswith("torch") for name in wheels)


def test_a_cross_bundle_refuses_a_source_archive_that_builds_a_binary_wheel(
    bundle: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = f"cp{RUNNING.replace('.', '')}"
    with pytest.raises(bundle.BundleError, match=rf"cext-1.0-{running}.*no wheel for Python {OTHER}"):
        _build(
            bundle,
            tmp_path,
            monkeypatch,
            {"cext": f"{running}-{running}-linux_x86_64"},
            "--python-version",
            OTHER,
        )
    _build(
        bundle, tmp_path / "same", monkeypatch, {"cext": f"{running}-{running}-linux_x86_64"}
    )  # same: fine

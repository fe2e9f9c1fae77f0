"""Issue 65 items 3 and 6: `evaluate.py translate.input=FILE translate.target_lang=fr` and a JSONL line's
`target_lang` with a multilingual checkpoint (tests/helpers/multilingual.py, untrained: its outputs depend
on the label only): each line's output equals its bilingual twin's for the hand-labelled line; a missing or
unknown language, a bilingual checkpoint asked for another one and an ensemble whose members' labels differ
are one error each, with no output file written."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from tests.helpers.cli import run_script
from tests.helpers.multilingual import SENTENCES, multilingual_checkpoint
from tests.helpers.repo import REPO_ROOT, cli_env
from transformer.cli.errors import ConfigError
from transformer.inference import InferenceError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return multilingual_checkpoint(tmp_path_factory.mktemp("multilingual"))


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., list[str]]]:
    """`run(ckpt, lines, *overrides)`: evaluate.py translating `lines` in this process; its output lines."""
    monkeypatch.setenv("PROJECT_ROOT", str(REPO_ROOT))
    from evaluate import evaluate

    def make(out_dir: Path, *overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
            return compose("eval", overrides=[f"paths.output_dir={out_dir}", "progress=false", *overrides])

    def translate(checkpoint: Path | str, lines: list[str], *overrides: str) -> list[str]:
        n = len(list(tmp_path.iterdir()))
        source, target = tmp_path / f"in{n}.txt", tmp_path / f"out{n}.txt"
        source.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        args = [f"ckpt_path={checkpoint}", f"translate.input={source}", f"translate.output={target}"]
        try:
            assert evaluate(make(tmp_path / f"run{n}", *args, *overrides)) == {}
        finally:
            assert not list(tmp_path.glob(f"out{n}.txt.*"))  # nothing left aside
        return target.read_text(encoding="utf-8").splitlines()

    yield translate


def test_target_lang_labels_every_line(run: Callable[..., list[str]], checkpoints: tuple[Path, Path]) -> None:
    multi, twin = checkpoints
    for lang in ("de", "fr"):
        got = run(multi, SENTENCES, f"translate.target_lang={lang}")
        assert got == run(twin, [f">>{lang}<< {s}" for s in SENTENCES])


def test_a_jsonl_lines_target_lang_wins(
    run: Callable[..., list[str]], checkpoints: tuple[Path, Path]
) -> None:
    multi, twin = checkpoints
    langs = ["fr", None, "de", "fr", None, "de"]
    lines = [json.dumps({"src": s, **({"target_lang": g} if g else {})}) for s, g in zip(SENTENCES, langs)]
    got = run(multi, lines, "translate.format=jsonl", "translate.target_lang=fr")
    labelled = [f">>{g or 'fr'}<< {s}" for s, g in zip(SENTENCES, langs)]
    expected = run(twin, [json.dumps({"src": s}) for s in labelled], "translate.format=jsonl")
    assert [json.loads(line)["translation"] for line in got] == [
        json.loads(line)["translation"] for line in expected
    ]


def test_n_best_with_a_label(run: Callable[..., list[str]], checkpoints: tuple[Path, Path]) -> None:
    multi, twin = checkpoints
    beam = ("decode.beam_size=3", "decode.n_best=2")
    got = run(multi, SENTENCES[:3], "translate.target_lang=de", *beam)
    assert got == run(twin, [f">>de<< {s}" for s in SENTENCES[:3]], *beam)


@pytest.mark.parametrize(
    ("lines", "overrides", "message"),
    [
        (SENTENCES[:2], [], r"^translate.target_lang: this model is multilingual; .*: de, fr \(or give"),
        (
            SENTENCES[:2],
            ["translate.target_lang=es"],
            r"^translate.target_lang: unknown target language 'es'",
        ),
        (
            [
                json.dumps({"src": "a dog", "target_lang": "de"}),
                json.dumps({"src": "a cat", "target_lang": "it"}),
            ],
            ["translate.format=jsonl"],
            r"line 2: target_lang: unknown target language 'it'; this model knows de, fr",
        ),
        (
            [json.dumps({"src": "a dog"})],
            ["translate.format=jsonl"],
            r"line 1: target_lang: this model is multilingual; choose a target language: de, fr",
        ),
        (
            [json.dumps({"src": "a dog", "target_lang": 5})],
            ["translate.format=jsonl"],
            r"line 1: target_lang must",
        ),
    ],
)
def test_bad_languages_are_one_error_and_write_nothing(
    run: Callable[..., list[str]],
    checkpoints: tuple[Path, Path],
    tmp_path: Path,
    lines: list[str],
    overrides: list[str],
    message: str,
) -> None:
    with pytest.raises((ConfigError, InferenceError), match=message):
        run(checkpoints[0], lines, *overrides)
    assert not list(tmp_path.glob("out*"))


def test_a_bilingual_checkpoint_asked_for_another_language(
    run: Callable[..., list[str]], checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    twin = checkpoints[1]
    assert run(twin, SENTENCES[:2], "translate.target_lang=de") == run(twin, SENTENCES[:2])
    with pytest.raises(
        ConfigError, match=r"^translate.target_lang: 'fr' given, but this model translates into 'de'"
    ):
        run(twin, SENTENCES[:2], "translate.target_lang=fr")


def test_the_command_line_says_it_in_one_line(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    multi, twin = checkpoints
    source, target = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("a dog runs .\n", encoding="utf-8")
    args = [f"translate.input={source}", f"translate.output={target}", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_script(
        "evaluate.py", [f"ckpt_path=[{multi},{twin}]", *args, "translate.target_lang=de"], env=cli_env()
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: ckpt_path: checkpoint {twin} has the target-language labels none (a bilingual model) but "
        f"{multi} has de: >>de<<, fr: >>fr<<: the members of an ensemble must share their labels"
    ], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not target.exists()

"""`evaluate.py translate.input=FILE translate.format=jsonl`: prefixes, constraints and avoided phrases per
line through the real command line, word alignments beside the translations, and every bad input form
as one `error:` line naming the file and line. The parser's checks run fast on a tiny BPE tokenizer; the
end-to-end tests (slow) on a tiny training run."""

from __future__ import annotations

import io
import json
import string
from pathlib import Path

import pytest

from data.synthetic import make_synthetic_splits
from data.tokenization import train_bpe
from tests.helpers import evaluate_runs, trained
from tests.helpers.evaluate_runs import run_in_project
from transformer.cli.errors import ConfigError
from transformer.cli.translate_input import EntryParser, text_lines

# the in-process evaluations of a tiny model: one thread is several times faster on a busy 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer() -> object:
    english, german = make_synthetic_splits(0, {"train": 300})["train"]
    return train_bpe([*english, *german], 200)


def _parser(tokenizer: object) -> EntryParser:
    return EntryParser("in.jsonl", tokenizer.encode, (tokenizer.bos_id, tokenizer.eos_id), tokenizer.unk_id)


def test_a_phrase_has_the_pieces_it_has_inside_a_sentence(tokenizer: object) -> None:
    """The BPE marks every word start with "▁", the first word of a text too: a phrase encoded alone
    is the very token sequence it becomes inside a sentence (where the search must produce it)."""
    entry = _parser(tokenizer)(1, json.dumps({"src": "x", "constraints": ["Äpfel und", "Autos"]}))
    sentence = tokenizer.encode("Wir brauchten achtzehn Äpfel und fünf Autos.")
    for phrase in entry.request.include:
        assert any(tuple(sentence[i : i + len(phrase)]) == phrase for i in range(len(sentence)))
    assert tokenizer.tokens("Autos")[1].startswith("▁")


BAD_LINES = {
    "malformed JSON": ('{"src": "a", ', "not JSON"),
    "not an object": ('["a"]', "not an object"),
    "unknown key": ('{"src": "a", "constrains": ["b"]}', "unknown key 'constrains'"),
    "no src": ('{"prefix": "a"}', "src must be a non-empty string"),
    "src not a string": ('{"src": 3}', "src must be a non-empty string"),
    "empty constraint": ('{"src": "a", "constraints": ["Autos", " "]}', "constraints[1] is empty"),
    "constraint not a list": ('{"src": "a", "constraints": "Autos"}', "constraints must be a list"),
    "constraint not a string": ('{"src": "a", "avoid": [1]}', "avoid[0] must be a string"),
    "unknown characters": ('{"src": "a", "constraints": ["Auto✈"]}', "cannot encode"),
    "prefix not a string": ('{"src": "a", "prefix": ["a"]}', "prefix must be a string"),
    "avoided and required": (
        '{"src": "a", "constraints": ["fünf Autos"], "avoid": ["Hunde", "fünf"]}',
        "avoid[1] 'fünf' occurs in constraints[0]",
    ),
    "avoided in the prefix": ('{"src": "a", "prefix": "fünf Autos", "avoid": ["Autos"]}', "occurs in prefix"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_each_bad_form_names_the_file_and_line(tokenizer: object, case: str) -> None:
    line, expected = BAD_LINES[case]
    with pytest.raises(ConfigError) as raised:
        _parser(tokenizer)(7, line)
    message = str(raised.value)
    assert message.startswith("in.jsonl line 7: ") and expected in message and "\n" not in message


def test_avoided_phrases_apart_from_the_wanted_ones_are_fine(tokenizer: object) -> None:
    line = '{"src": "a", "prefix": "fünf", "constraints": ["Autos"], "avoid": ["Hunde"]}'
    entry = _parser(tokenizer)(1, line)
    assert entry.request.avoid and entry.request.include and entry.request.prefix


def test_a_line_that_is_not_utf8_names_the_file_and_line() -> None:
    lines = text_lines(io.BytesIO(b"eins\nzwei\xff drei\n"), "in.txt")
    assert next(lines) == "eins\n"
    with pytest.raises(ConfigError, match=r"^in\.txt line 2: not UTF-8 text \(byte 0xff at byte 5"):
        next(lines)


# --- end to end -------------------------------------------------------------------------------------


translation_run = trained.translation_run  # the session's tiny quickstart run (tests/helpers/trained.py)


@pytest.fixture(scope="module")
def checkpoint(translation_run: Path) -> Path:
    return translation_run / "checkpoints" / "last.ckpt"


_run = run_in_project
compose_eval = evaluate_runs.compose_eval  # the fixture, by name in this module


LINES = [
    {"src": "They bought one car.", "prefix": "Sie kauften", "constraints": ["Autos", "achtzehn Äpfel"]},
    {"src": "She saw eighty-one eggs.", "constraints": ["Bälle"], "avoid": ["Eier", "sah"]},
    {"src": "We needed five cars.", "avoid": ["Wir"]},
    {"src": "They bought one car.", "constraints": [" ".join(["Äpfel und Autos"] * 12)]},  # too long
]


@pytest.mark.slow
@pytest.mark.parametrize("beam", [1, 4])
def test_jsonl_prefixes_constraints_and_alignments(
    checkpoint: Path, tmp_path: Path, compose_eval, beam: int
) -> None:
    from evaluate import evaluate

    source, target, alignments = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "align.txt"
    source.write_text(
        "\n".join(json.dumps(line, ensure_ascii=False) for line in LINES[:2])
        + "\n\n"
        + "\n".join(json.dumps(line, ensure_ascii=False) for line in LINES[2:])
        + "\n",
        encoding="utf-8",
    )
    overrides = [
        f"ckpt_path={checkpoint}",
        f"translate.input={source}",
        f"translate.output={target}",
        "translate.format=jsonl",
        f"translate.alignments={alignments}",
        f"decode.beam_size={beam}",
        f"decode.n_best={min(beam, 2)}",
        "decode.max_len_b=20",
    ]
    assert evaluate(compose_eval(tmp_path / "eval", *overrides)) == {}
    out = target.read_text(encoding="utf-8").split("\n")
    assert out[2] == "" and out[-1] == ""  # the blank line stays blank
    results = [json.loads(line) for line in out[:2] + out[3:5]]
    for line, result in zip(LINES, results):
        best = result["translation"]
        assert best.startswith(line.get("prefix", ""))
        assert not result["unsatisfiable"] or line is LINES[3]
        if line is not LINES[3]:
            words = [word.strip(string.punctuation) for word in best.split()]  # whole words, not "Autosx"
            for phrase in map(str.split, line.get("constraints", [])):
                assert any(words[i : i + len(phrase)] == phrase for i in range(len(words))), (best, line)
        for hypothesis in result.get("n_best", [result]):
            words = hypothesis["translation"].split()
            assert not any(phrase in words for phrase in line.get("avoid", [])), hypothesis
            pairs = [tuple(map(int, pair.split("-"))) for pair in hypothesis["alignment"].split()]
            assert sorted(j for _, j in pairs) == list(range(len(words)))  # one pair per output word
            assert all(0 <= i < len(line["src"].split()) for i, _ in pairs)
    assert results[3]["unsatisfiable"]
    aligned = alignments.read_text(encoding="utf-8").split("\n")
    assert aligned[:2] + aligned[3:5] == [result["alignment"] for result in results] and aligned[2] == ""


@pytest.mark.slow
def test_stdin_bad_lines_and_split_alignments(checkpoint: Path, tmp_path: Path, compose_eval) -> None:
    """stdin in, one error line for a bad line; decode.alignments=true beside a scored split's hypotheses."""
    from evaluate import evaluate

    good = json.dumps({"src": "They bought one car.", "prefix": "Sie"})
    done = _run(
        "evaluate.py",
        [
            f"ckpt_path={checkpoint}",
            f"hydra.run.dir={tmp_path / 'a'}",
            "translate.input=-",
            "translate.format=jsonl",
        ],
        stdin=good + "\n",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["translation"].startswith("Sie")
    bad = _run(
        "evaluate.py",
        [
            f"ckpt_path={checkpoint}",
            f"hydra.run.dir={tmp_path / 'b'}",
            "translate.input=-",
            "translate.format=jsonl",
        ],
        stdin=good + '\n{"src": "x", "avoid": [""]}\n',
    )
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode == 1 and errors == [
        "error: stdin line 2: avoid[0] is empty; a phrase needs at least one word"
    ]
    assert "Traceback" not in bad.stderr
    # the scored split's files: in this process (the command line's stdin and exit status are checked above)
    scored = [f"ckpt_path={checkpoint}", "decode.alignments=true", "report.enabled=false"]
    evaluate(compose_eval(tmp_path / "c", *scored))
    hypotheses = (tmp_path / "c" / "hypotheses.txt").read_text(encoding="utf-8").splitlines()
    lines = (tmp_path / "c" / "alignments.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(hypotheses) == trained.TEST_SENTENCES
    for line, hypothesis in zip(lines, hypotheses):
        assert sorted(int(pair.split("-")[1]) for pair in line.split()) == list(
            range(len(hypothesis.split()))
        )
    evaluate(compose_eval(tmp_path / "d", *scored, "decode.beam_size=4", "decode.n_best=3"))
    entries = [line.split(" ||| ") for line in (tmp_path / "d" / "nbest.txt").read_text("utf-8").splitlines()]
    aligned = [
        line.split(" ||| ") for line in (tmp_path / "d" / "alignments.txt").read_text("utf-8").splitlines()
    ]
    # one line per hypothesis, in the n-best list's order
    assert len(aligned) == len(entries) > trained.TEST_SENTENCES
    for (index, text, _), (same_index, pairs) in zip(entries, aligned):
        assert index == same_index
        assert sorted(int(pair.split("-")[1]) for pair in pairs.split()) == list(range(len(text.split())))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["text", "jsonl"])
def test_a_binary_input_file_is_one_error_naming_file_and_line(
    checkpoint: Path, tmp_path: Path, compose_eval, form: str
) -> None:
    """#40: a non-UTF-8 file said only "'utf-8' codec can't decode byte 0xff in position 2"."""
    from evaluate import evaluate

    source = tmp_path / "in.bin"
    source.write_bytes(b'{"src": "They bought one car."}\n\x89PNG\xff\x00\n')
    overrides = [f"ckpt_path={checkpoint}", f"translate.input={source}", f"translate.format={form}"]
    with pytest.raises(
        ConfigError, match=rf"^{source} line 2: not UTF-8 text \(byte 0x89 at byte 1 of the line\)"
    ):
        evaluate(compose_eval(tmp_path / "eval", *overrides))

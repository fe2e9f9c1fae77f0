"""Every `python train.py ...` and `python evaluate.py ...` command that README.md and docs/ show runs.

Each command runs as written, with tiny overrides appended: one epoch of two training steps of small
batches (`data.max_tokens`) of a model a quarter of the experiment's width where the command trains a new
one (not `model.init_from`, a resumed run or an Optuna search space), one validation and one test batch,
small copies of the real datasets in
place of `data.data_dir` (and of the hub download for commands without one), one Optuna trial, sweeps cut
to two jobs (one under `hydra/launcher=local`, whose first command only runs through it), run directories
under a temporary directory. Placeholders (`PATH`, `<run>`, `NAME`, `seed=S`, `[...]`, paths under
`logs/` or `pretrained/` (an OPUS-MT model, a BERT classifier: tiny ones imported here), and any value of
`distill.teachers`, `backtranslate.model`, `backtranslate.monolingual`) become a checkpoint, run or file
made here: for evaluate.py a Multi30k de -> en run, or the quickstart's run (en -> de) where the command
says `ckpt_path=<quickstart-run>/...`, or the multilingual quickstart's (`<multilingual-run>`). Commands
that cannot run on this machine (a GPU, SLURM, a hub-only corpus) are composed with `--cfg job` instead,
each job of a sweep on its own. All of them run in one interpreter (`tests/helpers/driver.py`), so the
libraries are imported once.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.driver import run_in_one_interpreter
from tests.helpers.pretrained import bert_directory, opus_mt_directory
from tests.helpers.repo import REPO_ROOT, cli_env
from transformer.interop import import_cli

pytestmark = pytest.mark.slow

DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
EXPERIMENTS = sorted(p.stem for p in (REPO_ROOT / "configs" / "experiment").glob("*.yaml"))
HUB_ONLY = {"iwslt14_de_en", "wmt14_en_de_base"}  # corpora with no local layout: composed only
SYNTHETIC_MODELS = ("distill.teachers", "backtranslate.model")  # docs/distillation.md's placeholders
CANNOT_RUN_HERE = {"trainer=gpu", "trainer=ddp", "device=cuda", "hydra/launcher=slurm"}
# each job of the local launcher is a fresh process (submitit; ~15 s here): the first such command runs
# through it, later ones with Hydra's basic launcher (their settings run; the launcher's parallel jobs, their
# outputs and a failing job: test_sweeps' grid under hydra/launcher=local)
LOCAL_LAUNCHER, BASIC_LAUNCHER = "hydra/launcher=local", "hydra/launcher=basic"
# what evaluate.py commands decode: untrained translations run to the length limit, and their decoding and
# attention heatmaps were three quarters of this test's time; a training run's validation and test
# translations likewise (a quarter of a tiny run)
EVAL_LENGTH = {"max_len_a": 0, "max_len_b": 8}
# padded tokens per training batch (the experiments' 2048-4096 made each command's two steps, its validation
# batch and its test batch most of its time; every example of the tiny data fits: data.max_len is at most 128)
TINY_BATCH = 256
# a quarter of the experiments' width (the layers, heads and every setting stay): a new model's training
# command ran 2.0 s with the experiment's width and 1.25 s with this one (checkpoints of 5 MB, not 72 MB);
# the Multi30k runs that stand for `logs/...` checkpoints too (evaluated, averaged, ensembled, fine-tuned,
# distilled from), so that each evaluate.py command loads, averages and decodes the small ones
SMALL_MODEL = ["model.config.d_model=64", "model.config.d_ff=256"]
FIXTURE_RUNS = ("quickstart", "multilingual", "multi30k", "multi30k_en_de")  # the checkpoints made here
COMMAND = re.compile(
    r"""(?:echo\s+(?P<stdin>"[^"]*"|'[^']*')\s*\|\s*)?python\s+(?P<script>train|evaluate)\.py\b(?P<rest>.*)"""
)


@dataclass
class Documented:
    where: str  # README.md:123
    text: str
    script: str
    args: list[str]
    stdin: str = ""
    dataset: str | None = None  # multi30k | sst2: needs that dataset's tiny copy
    steps: list[dict] = field(default_factory=list)  # what the driver runs for it


def _spans(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each fenced line (with `\\` continuations joined) and each inline span."""
    found: list[tuple[int, str]] = []
    lines = text.splitlines()
    prose = []
    fenced, index = False, 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced:
            start = index
            while line.endswith("\\") and index + 1 < len(lines):
                index += 1
                line = line[:-1] + " " + lines[index].strip()
                prose.append("")
            found.append((start + 1, line))
            prose.append("")
        else:
            prose.append(line)
        index += 1
    joined = "\n".join(prose)
    for match in re.finditer(r"(`+)(.+?)\1", joined, re.DOTALL):  # ``a `b` c`` holds backticks
        found.append((joined.count("\n", 0, match.start()) + 1, " ".join(match.group(2).split())))
    return sorted(found)


def documented_commands() -> list[Documented]:
    commands, seen = [], set()
    for document in DOCUMENTS:
        for line, code in _spans(document.read_text()):
            match = COMMAND.search(code)
            if not match:
                continue
            # a synopsis's optional part, `[key=value ...]`, goes; a list value, `key=[a,b]`, stays
            rest = re.sub(r"(?<!=)\[[^\]]*\]", " ", match.group("rest"))
            args = shlex.split(rest, comments=True)
            text = " ".join(["python", f"{match.group('script')}.py", *args])
            if text in seen:
                continue
            seen.add(text)
            stdin = (match.group("stdin") or "")[1:-1]
            where = f"{document.relative_to(REPO_ROOT)}:{line}"
            commands.append(
                Documented(where, text, f"{match.group('script')}.py", args, stdin + "\n" * bool(stdin))
            )
    return commands


COMMANDS = documented_commands()


# --- what each command becomes ---------------------------------------------------------------------


def _split_values(value: str) -> list[str]:
    """`1,2,3` -> ['1', '2', '3'] (commas inside brackets stay: `choice(2,4)`, `[maximize,minimize]`)."""
    parts, depth, current = [], 0, ""
    for char in value:
        depth += (char in "([") - (char in ")]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _dataset(args: list[str]) -> str | None:
    names = " ".join(
        a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in ("experiment", "hparams_search")
    )
    # experiment=finetune_opus_mt fine-tunes a de -> en import on Multi30k
    marks = {"multi30k": ("multi30k", "opus_mt"), "sst2": ("sst2",)}
    return next((d for d, words in marks.items() if any(w in names for w in words)), None)


def _plan(
    command: Documented, tmp: Path, data: dict[str, Path], fixtures: dict[str, Path], index: int
) -> None:
    multirun = "-m" in command.args or "--multirun" in command.args
    args = [a for a in command.args if a not in ("-m", "--multirun")]
    args = ["experiment=quickstart" if a == "experiment=NAME" else a for a in args]
    args = ["seed=1" if a in ("seed=S", "seed=...") else a for a in args]
    evaluating = command.script == "evaluate.py"
    # evaluate.py decodes a Multi30k de -> en run unless the command names the quickstart's (en -> de) or
    # the multilingual quickstart's (en, de, fr; docs/multilingual.md)
    named = next(
        (
            n
            for n in ("quickstart", "multilingual")
            if any(f"{key}=<{n}-run>" in " ".join(args) for key in ("ckpt_path", "model.init_from"))
        ),
        None,
    )
    quickstart = not evaluating or named is not None
    # a BERT import (pretrained/bert-*: a tiny one imported here) is a classifier of SST-2
    bert = "bert" in fixtures and any(
        a.partition("=")[0] in ("ckpt_path", "model.init_from")
        and a.partition("=")[2].startswith("pretrained/bert")
        for a in args
    )
    command.dataset = _dataset(args) or ("sst2" if bert else None if quickstart else "multi30k")
    # a run's path (logs/...) stands for a checkpoint trained here; an OPUS-MT model's (pretrained/opus-mt-*)
    # for a tiny OPUS-MT-shaped model imported here (tests/helpers/pretrained.py), other imports for the
    # de -> en run
    placeholders = re.compile(r"PATH|<[^>]*>|\.\.\.|^logs/|^pretrained/")
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if (
            key in ("ckpt_path", "model.init_from")
            and value.startswith("pretrained/opus-mt")
            and "opus" in fixtures
        ):
            args[i] = f"{key}={fixtures['opus']}"
        elif key in ("ckpt_path", "model.init_from") and value.startswith("pretrained/bert") and bert:
            args[i] = f"{key}={fixtures['bert']}"
        elif key == "model.init_from" and placeholders.search(value):
            args[i] = f"{key}={fixtures[named or 'multi30k'] / 'checkpoints' / 'last.ckpt'}"
        elif key == "ckpt_path" and placeholders.search(value):
            run = fixtures[named or ("quickstart" if quickstart else "multi30k")]
            averaging = any(a.startswith("average_last=") for a in args)
            path = run if averaging else run / "checkpoints" / "last.ckpt"
            members = value.count(",") + 1 if value.startswith("[") else 0  # an ensemble: that many
            args[i] = f"ckpt_path=[{','.join([str(path)] * members)}]" if members else f"ckpt_path={path}"
        elif key in SYNTHETIC_MODELS:  # teachers: a de -> en run; a reverse model: the student's reverse
            reverse = key == "backtranslate.model" and "experiment=multi30k_de_en" in args
            path = fixtures["multi30k_en_de" if reverse else "multi30k"] / "checkpoints" / "last.ckpt"
            members = value.count(",") + 1 if value.startswith("[") else 0
            args[i] = f"{key}=[{','.join([str(path)] * members)}]" if members else f"{key}={path}"
        elif key == "backtranslate.monolingual" and "multi30k" in data:  # FILE: the student's target text
            language = "en" if "experiment=multi30k_de_en" in args else "de"
            args[i] = f"{key}={data['multi30k'] / f'train.{language}.gz'}"
        elif key == "data.data_dir":
            args[i] = f"data.data_dir={data.get(command.dataset or '', value)}"
    compose_only = any(a in CANNOT_RUN_HERE for a in args) or any(
        a.startswith("experiment=") and (a.split("=", 1)[1] in HUB_ONLY or "glob(" in a) for a in args
    )
    if compose_only or "--cfg" in args:
        _compose_steps(command, args, multirun)
        return
    if command.dataset and not any(a.startswith("data.data_dir=") for a in args):
        args.append(f"data.data_dir={data[command.dataset]}")  # in place of the hub download
    if multirun:  # two jobs: the first swept key's first two values, the first value of any other swept
        # key (the product of keys is Hydra's basic sweeper); one under the local launcher (LOCAL_LAUNCHER)
        jobs = 1 if LOCAL_LAUNCHER in args else 2
        for i, arg in enumerate(args):
            key, _, value = arg.partition("=")
            values = _split_values(value) if value else []
            if len(values) > 1:
                args[i] = f"{key}={','.join(values[:jobs])}"
                jobs = 1
        args.insert(0, "-m")
    if evaluating:
        tiny = [f"hydra.run.dir={tmp / 'eval' / str(index)}", f"hydra.sweep.dir={tmp / 'eval' / str(index)}"]
        if command.dataset != "sst2":  # a 10-step model never ends a sentence: 8 tokens, not 1.2 * src + 10
            tiny += [f"decode.{k}={v}" for k, v in EVAL_LENGTH.items() if not _sets(args, f"decode.{k}")]
        if not _sets(args, "report.attention_examples"):  # one sentence's heatmaps (a report's slowest part)
            tiny.append("report.attention_examples=1")
    else:
        tiny = [  # one epoch of two steps, validated: sweeps get their objective
            "trainer.max_epochs=1",
            "++trainer.limit_train_batches=2",
            "++trainer.limit_val_batches=1",
            "++trainer.limit_test_batches=1",
            "++callbacks.rich_progress_bar=null",
            "logger=csv",
            f"paths.log_dir={tmp / 'logs' / str(index)}",
            f"paths.cache_dir={tmp / 'cache'}",
        ]
        if not _sets(args, "data.max_tokens"):  # batches of a few sentences: the steps were half the time
            tiny.append(f"data.max_tokens={TINY_BATCH}")
        if any(a.startswith("hparams_search=") for a in args):
            tiny.append("hydra.sweeper.n_trials=1")
        elif not any(a.lstrip("+").startswith(("model.init_from=", "ckpt_path=", "model=")) for a in args):
            tiny += [a for a in SMALL_MODEL if not _sets(args, a.split("=", 1)[0])]
        if command.dataset != "sst2" and not any(a.startswith("model=") for a in args):  # translation
            tiny += [
                f"model.decoding.{k}={v}"
                for k, v in EVAL_LENGTH.items()
                if not _sets(args, f"model.decoding.{k}")
            ]
        for key in SYNTHETIC_MODELS:  # a 10-step teacher: translations of 1 to 3 tokens, none empty
            if any(a.startswith(f"{key}=") for a in args):
                group = key.split(".")[0]
                tiny += [f"{group}.decode.{k}" for k in ("max_len_a=0", "max_len_b=3", "min_len=1")]
    ddp = any(a.startswith("trainer=ddp") for a in args)
    command.steps = [
        {
            "script": str(REPO_ROOT / command.script),
            "args": args + tiny,
            "stdin": command.stdin,
            "subprocess": ddp,
        }
    ]


def _sets(args: list[str], key: str) -> bool:
    return any(a.lstrip("+").split("=", 1)[0] == key for a in args)


def _compose_steps(command: Documented, args: list[str], multirun: bool) -> None:
    """`--cfg job` for each job of the sweep (every experiment of a glob, the first value otherwise)."""
    jobs: list[list[str]] = [[]]
    for arg in args:
        key, _, value = arg.partition("=")
        if value.startswith("glob("):
            values = EXPERIMENTS if key == "experiment" else [value]
        elif multirun and value:
            values = _split_values(value)[:1]
        else:
            values = [value] if "=" in arg else []
        if not values:  # a flag
            jobs = [[*job, arg] for job in jobs]
            continue
        jobs = [[*job, f"{key}={v}"] for job in jobs for v in values]
    command.steps = [
        {
            "script": str(REPO_ROOT / command.script),
            "args": [*[a for a in job if a != "--cfg" and a != "job"], "--cfg", "job"],
        }
        for job in jobs
    ]


# --- the run --------------------------------------------------------------------------------------


def _tiny_multi30k(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in source.glob("*.gz"):
        split = path.name.split(".")[0]
        keep = 300 if split == "train" else 10
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(keep), f)]
        with gzip.open(target / path.name, "wt", encoding="utf-8") as f:
            f.writelines(lines)
    return target


def _tiny_sst2(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in source.iterdir():
        opener = gzip.open if path.suffix == ".gz" else open
        keep = 301 if path.name.startswith("train") else 11  # with the header
        with opener(path, "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(keep), f)]
        with opener(target / path.name, "wt", encoding="utf-8") as f:
            f.writelines(lines)
    return target


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("readme")
    data = {}
    if os.environ.get("MULTI30K_DIR"):
        data["multi30k"] = _tiny_multi30k(Path(os.environ["MULTI30K_DIR"]), tmp / "multi30k")
    if os.environ.get("SST2_DIR"):
        data["sst2"] = _tiny_sst2(Path(os.environ["SST2_DIR"]), tmp / "sst2")
    fixtures = {name: tmp / "fixtures" / name for name in FIXTURE_RUNS}
    # the runs the placeholders point at: the quickstart, the multilingual one, a Multi30k run with five
    # checkpoints
    base = ["++callbacks.rich_progress_bar=null", "logger=csv", f"paths.cache_dir={tmp / 'cache'}"]
    steps = [
        {
            "script": str(REPO_ROOT / "train.py"),
            "args": [*base, "trainer.max_steps=2", f"hydra.run.dir={fixtures['quickstart']}"],
        },
        {
            "script": str(REPO_ROOT / "train.py"),
            "args": [
                *base,
                "experiment=quickstart_multilingual",
                "trainer.max_steps=2",
                "++trainer.limit_val_batches=1",
                "test=false",
                f"hydra.run.dir={fixtures['multilingual']}",
            ],
        },
    ]
    if "multi30k" in data:
        steps.append(
            {
                "script": str(REPO_ROOT / "train.py"),
                "args": [
                    *base,
                    "experiment=multi30k_de_en",
                    f"data.data_dir={data['multi30k']}",
                    f"data.max_tokens={TINY_BATCH}",
                    *SMALL_MODEL,
                    "trainer.max_steps=10",
                    "++trainer.limit_train_batches=2",
                    "++trainer.limit_val_batches=1",
                    "++trainer.limit_test_batches=1",
                    "callbacks.model_checkpoint.save_top_k=-1",
                    f"hydra.run.dir={fixtures['multi30k']}",
                ],
            }
        )
        steps.append(  # the reverse model of a de -> en student's back-translation
            {
                "script": str(REPO_ROOT / "train.py"),
                "args": [
                    *base,
                    "experiment=multi30k_en_de",
                    f"data.data_dir={data['multi30k']}",
                    f"data.max_tokens={TINY_BATCH}",
                    *SMALL_MODEL,
                    "trainer.max_steps=2",
                    "++trainer.limit_val_batches=1",
                    "test=false",
                    f"hydra.run.dir={fixtures['multi30k_en_de']}",
                ],
            }
        )
        # an OPUS-MT model as aiayn-import makes it (SentencePiece models trained on Multi30k's first lines)
        opus = opus_mt_directory(tmp / "opus-mt-de-en", Path(os.environ["MULTI30K_DIR"]))
        assert import_cli.main([str(opus), "--output", str(tmp / "fixtures" / "opus")]) == 0
        fixtures["opus"] = tmp / "fixtures" / "opus" / "model.ckpt"
    if "sst2" in data:  # a BERT classifier as aiayn-import makes it (WordPiece trained on SST-2's lines)
        bert = bert_directory(tmp / "bert", Path(os.environ["SST2_DIR"]), num_labels=2)
        assert import_cli.main([str(bert), "--output", str(tmp / "fixtures" / "bert")]) == 0
        fixtures["bert"] = tmp / "fixtures" / "bert" / "model.ckpt"
    fixture_steps = len(steps)
    owners: list[tuple[str, int]] = []
    launched = False  # the first command under the local launcher runs through it, later ones in this process
    for index, command in enumerate(COMMANDS):
        _plan(command, tmp, data, fixtures, index)
        if command.dataset and command.dataset not in data:
            continue
        for step in command.steps:
            if LOCAL_LAUNCHER in step["args"]:
                if launched:
                    step["args"] = [BASIC_LAUNCHER if a == LOCAL_LAUNCHER else a for a in step["args"]]
                launched = True
            owners.append((command.where, len(steps)))
            steps.append(step)
    env = cli_env(WANDB_MODE="offline", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    ran = run_in_one_interpreter(steps, timeout=1500, env=env)
    for i in range(fixture_steps):
        assert ran[i].returncode == 0, f"fixture run {steps[i]['args']} failed:\n{ran[i].stderr[-3000:]}"
    by_command: dict[str, dict] = {}
    for where, i in owners:
        entry = by_command.setdefault(where, {"runs": []})
        result = ran[i]
        entry["runs"].append(
            {"status": result.returncode, "output": result.stdout + result.stderr, "args": steps[i]["args"]}
        )
    return by_command


def test_the_documents_show_commands() -> None:
    assert len(COMMANDS) >= 10, [c.text for c in COMMANDS]
    assert any(c.text == "python train.py" for c in COMMANDS)


def test_a_command_on_the_quickstart_checkpoint_decodes_the_quickstart_run(tmp_path: Path) -> None:
    """docs/decoding.md's first JSON-lines example translates English into German: it runs on the
    checkpoint a newcomer has, the quickstart's (issue 51: it needed a de -> en model)."""
    named = [c for c in COMMANDS if "ckpt_path=<quickstart-run>/" in c.text]
    assert [c.where.split(":")[0] for c in named] == ["docs/decoding.md"]
    fixtures = {name: tmp_path / name for name in FIXTURE_RUNS}
    for command in map(dataclasses.replace, named):  # planned on a copy
        _plan(command, tmp_path, {"multi30k": tmp_path / "data"}, fixtures, 0)
        (step,) = command.steps
        assert f"ckpt_path={fixtures['quickstart'] / 'checkpoints' / 'last.ckpt'}" in step["args"]
        assert command.dataset is None and not any(a.startswith("data.data_dir=") for a in step["args"])
        assert json.loads(command.stdin)["prefix"] == "Gestern"


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_runs(command: Documented, results: dict[str, dict]) -> None:
    if command.where not in results:
        env = {"multi30k": "MULTI30K_DIR", "sst2": "SST2_DIR"}[command.dataset or "multi30k"]
        pytest.skip(f"{command.text} needs {env} (see tests/conftest.py)")
    for run in results[command.where]["runs"]:
        output = run["output"]
        assert run["status"] == 0, f"{command.text}\nran as: {' '.join(run['args'])}\n{output[-4000:]}"
        assert "Traceback" not in output, f"{command.text}\n{output[-4000:]}"

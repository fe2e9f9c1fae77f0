"""Synthetic training pairs for `train.py`: distillation (`distill.*`: the teachers' translations of the
training sources) and back-translation (`backtranslate.*`: a reverse model's translations of
target-language text). Everything is checked before any work; the translations come from the prepared-data
cache or are made there once (`distill.corpus`), are copied into the run directory as plain text,
and reach the datamodule as extra pair files (`data.extra_train`, `data.train_copies`): `data/` reads them
like any local corpus and trains the student's own tokenizer on them.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from data import cache as data_cache
from data.sources import DataError, iter_lines
from transformer.cli import build
from transformer.cli.distill.corpus import TRANSLATIONS, Shard, translate_corpus
from transformer.cli.distill.teachers import Teachers, load_translator
from transformer.cli.errors import ConfigError
from transformer.disk import write_text

log = logging.getLogger("train")

MIXES = ("distilled", "both")


@dataclass
class Plan:
    """What one run translates: `texts` with `translator`, into the cache entry `name`."""

    name: str  # "distill" | "backtranslate"
    translator: Teachers
    texts: list[str]
    options: Mapping[str, Any]


def wanted(cfg: DictConfig) -> bool:
    """Whether this run trains on synthetic pairs (teachers given, or a reverse model). Without teachers,
    a distillation setting that only makes sense with them is refused (ConfigError)."""
    if _teachers(cfg):
        return True
    _check_teacherless(cfg)
    return OmegaConf.select(cfg, "backtranslate.model", default=None) is not None


def _check_teacherless(cfg: DictConfig) -> None:
    """No teachers: the distillation recipes (`distill.required`), `distill.mix=both` and
    `distill.ensemble_weights` would train a plain model silently."""
    need = "give the teachers: 'distill.teachers=[a.ckpt,b.ckpt]'"
    if OmegaConf.select(cfg, "distill.required", default=False):
        raise ConfigError(
            f"this experiment distils (distill.required=true), but distill.teachers is empty: {need}"
        )
    mix = OmegaConf.select(cfg, "distill.mix", default="distilled")
    if mix != "distilled":
        raise ConfigError(
            f"distill.mix={mix} mixes in the teachers' translations, but there are none: {need}"
        )
    if OmegaConf.select(cfg, "distill.ensemble_weights", default=None) is not None:
        raise ConfigError(f"distill.ensemble_weights weighs teachers, but distill.teachers is empty: {need}")


def add_synthetic_pairs(cfg: DictConfig, plan: Plan, trainer: Any | None = None) -> None:
    """Translate (or reuse) what `plan` (checked by `make_plan`) says and hand the synthetic pairs to
    `cfg.data`. With a DDP `trainer` the processes are started now and each translates its share."""
    if trainer is not None and trainer.world_size > 1 and trainer.strategy.launcher is not None:
        entry = trainer.strategy.launcher.launch(_translate_in_ddp, cfg, plan, trainer, trainer=trainer)
    else:
        entry = translate(cfg, plan, Shard())
    _hand_to_data(cfg, plan, entry)


def make_plan(cfg: DictConfig) -> Plan:
    """The translator and the sentences of `distill` or `backtranslate`, every setting, checkpoint and
    file checked (before any work)."""
    teachers, reverse = _teachers(cfg), OmegaConf.select(cfg, "backtranslate.model", default=None)
    if teachers and reverse is not None:
        raise ConfigError("distill.teachers and backtranslate.model: use one of them in a run")
    if not teachers:
        _check_path("backtranslate.model", str(reverse))
    name = "distill" if teachers else "backtranslate"
    options = OmegaConf.to_container(cfg[name], resolve=True)
    assert isinstance(options, dict)
    _check_options(name, options)
    src, tgt = str(cfg.data.src_lang), str(cfg.data.tgt_lang)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data, dict)
    common = {"data": data, "max_tokens": options.get("max_tokens"), "device": str(options["device"])}
    common["decode_values"] = options.get("decode")
    if name == "distill":
        translator = load_translator(
            "distill.teachers",
            teachers,
            direction=(src, tgt),
            weights=options.get("ensemble_weights"),
            **common,
        )
        datamodule = build.instantiate(cfg.data, "data")
        texts = list(datamodule.sources(datamodule.splits["train"]))
    else:
        texts = read_monolingual(options.get("monolingual"))
        translator = load_translator("backtranslate.model", [reverse], direction=(tgt, src), **common)
    return Plan(name, translator, texts, options)


def _teachers(cfg: DictConfig) -> list[str]:
    value = OmegaConf.select(cfg, "distill.teachers", default=None)
    if value is None:
        return []
    if not isinstance(value, (str, ListConfig)):
        raise ConfigError(f"distill.teachers must be a list of checkpoints '[a.ckpt,b.ckpt]', got {value!r}")
    paths = [value] if isinstance(value, str) else [str(path) for path in value]
    for index, path in enumerate(paths):
        _check_path("distill.teachers" if isinstance(value, str) else f"distill.teachers[{index}]", path)
    return paths


def _check_path(key: str, path: str) -> None:
    """An empty checkpoint path (`distill.teachers=['']`) would be read as the current directory."""
    if not path.strip():
        raise ConfigError(f"{key} is an empty path: give the path of a .ckpt file")


def _check_options(name: str, options: Mapping[str, Any]) -> None:
    chunk = options.get("chunk_sentences")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"{name}.chunk_sentences must be an integer >= 1, got {chunk!r}")
    if name == "distill" and options.get("mix") not in MIXES:
        raise ConfigError(f"distill.mix must be one of {list(MIXES)}, got {options.get('mix')!r}")
    if name == "backtranslate":
        copies = options.get("real_copies")
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
            raise ConfigError(f"backtranslate.real_copies must be an integer >= 0, got {copies!r}")
        tag = options.get("tag")
        if tag is not None and (not isinstance(tag, str) or not tag or any(c.isspace() for c in tag)):
            raise ConfigError(f"backtranslate.tag must be one word (e.g. <bt>) or null, got {tag!r}")


def read_monolingual(path: Any) -> list[str]:
    """The non-blank lines of `backtranslate.monolingual` (plain or .gz); an empty or binary file refused."""
    if path in (None, ""):
        raise ConfigError("backtranslate.monolingual=FILE is required with backtranslate.model")
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise ConfigError(f"backtranslate.monolingual: {file} does not exist")
    try:
        lines = []
        for number, line in enumerate(iter_lines(file), start=1):
            if "\x00" in line:
                raise ConfigError(
                    f"backtranslate.monolingual: {file}:{number} holds NUL bytes: a binary file?"
                )
            if line:
                lines.append(line)
    except DataError as err:  # invalid UTF-8, a broken .gz
        raise ConfigError(
            f"backtranslate.monolingual: {err} (expected UTF-8 text, one sentence a line)"
        ) from None
    if not lines:
        raise ConfigError(f"backtranslate.monolingual: {file} is empty (no line with text)")
    return lines


def cache_key(plan: Plan, seed: int) -> str:
    """What decides the translations: the models' weights, the decoding settings, the sentences, the
    chunking (and, for sampling, the seed). `kv_cache` changes the speed, not the output."""
    translator = plan.translator
    return data_cache.cache_key(
        {
            "kind": plan.name,
            "models": translator.digest,
            "decoding": {k: v for k, v in translator.decoding.items() if k != "kv_cache"},
            "texts": hashlib.sha256("".join(f"{text}\n" for text in plan.texts).encode()).hexdigest(),
            "lines": len(plan.texts),
            "max_len": translator.datamodule.max_len,
            "chunk_sentences": plan.options["chunk_sentences"],
            "seed": seed if translator.decoding.sampling else None,
        }
    )


def translate(cfg: DictConfig, plan: Plan, shard: Shard) -> Path:
    """The cache entry of the plan's translations (made now by this process's share when missing)."""
    seed = int(cfg.get("seed") or 0)
    directory = Path(str(cfg.paths.cache_dir)) / "synthetic"
    companions = {"sources.txt" if plan.name == "distill" else "targets.txt": plan.texts}
    return translate_corpus(
        plan.texts,
        plan.translator.chunk_function(seed),
        directory=directory,
        name=plan.name,
        key=cache_key(plan, seed),
        chunk_sentences=plan.options["chunk_sentences"],
        companions=companions,
        shard=shard,
    )


def _translate_in_ddp(cfg: DictConfig, plan: Plan, trainer: Any) -> Path:
    """In every DDP process (started by the launcher): join the process group, translate this rank's
    chunks, meet the others at the barrier; rank 0 writes the corpus."""
    trainer.strategy.setup_environment()
    if plan.options["device"] == "auto":
        plan.translator.to(trainer.strategy.root_device)
    shard = Shard(trainer.global_rank, trainer.world_size, trainer.strategy.barrier)
    return translate(cfg, plan, shard)


def _hand_to_data(cfg: DictConfig, plan: Plan, entry: Path) -> None:
    """Plain-text copies in the run directory, and the pair files as `data.extra_train`."""
    src, tgt = str(cfg.data.src_lang), str(cfg.data.tgt_lang)
    if plan.name == "distill":
        pair = {"src": str(entry / "sources.txt"), "tgt": str(entry / TRANSLATIONS), "tag": None}
        copies = 0 if plan.options["mix"] == "distilled" else 1
    else:
        pair = {
            "src": str(entry / TRANSLATIONS),
            "tgt": str(entry / "targets.txt"),
            "tag": plan.options["tag"],
        }
        copies = plan.options["real_copies"]
    files = {f"train.{src}": pair["src"], f"train.{tgt}": pair["tgt"]}
    if (cfg.get("train") or cfg.get("test")) and rank_zero_only.rank == 0:
        run_dir = Path(str(cfg.paths.output_dir)) / plan.name
        run_dir.mkdir(parents=True, exist_ok=True)
        for name, path in files.items():
            text = Path(path).read_text(encoding="utf-8")
            write_text(run_dir / name, text, f"the {plan.name} corpus")
    with open_dict(cfg):
        cfg.data.extra_train = [pair]
        cfg.data.train_copies = copies
    log.info(
        "%s: training on %d synthetic pairs%s",
        plan.name,
        len(plan.texts),
        f" and the real pairs x{copies}" if copies else " only",
    )

"""Fine-tuning: `model.init_from` of a translation or classification checkpoint (its config, tokenizer and
weights taken, what contradicts it refused in one line, its fit checks at their exact boundaries),
`finetune.freeze`, and the refusals. LoRA's own tests: test_lora.py."""

from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from tests.helpers.finetune import RANK, D, copy_batch, logits_of, randomize_adapters, tiny_task
from tests.helpers.tasks import TINY, CopyData, cpu_trainer
from transformer.checkpoint import CheckpointError
from transformer.cli.errors import ConfigError
from transformer.cli.init_from import explicit_keys, take_init_from
from transformer.config import TransformerConfig
from transformer.evaluation.init_from import load_pretrained_translation
from transformer.lora import FinetuneSettings, LoraSettings
from transformer.model import Seq2SeqTransformer
from transformer.training import ClassificationTask, TranslationTask
from transformer.training.optim import adamw

TOKENIZERS = {"joint": '{"a tokenizer": 1}'}


def _save(task, path, tokenizers=TOKENIZERS, data=None):
    """A checkpoint as train.py writes one: weights, hyperparameters, config, the datamodule's tokenizers."""
    checkpoint = {
        "state_dict": task.state_dict(),
        "hyper_parameters": dict(task.hparams),
        "config": {"model": {"_target_": f"transformer.training.{type(task).__name__}"}, "data": data or {}},
        f"{type(task).__name__.removesuffix('Task')}DataModule": {"tokenizers": tokenizers},
    }
    torch.save(checkpoint, path)
    return str(path)


# --- freeze -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("freeze", "frozen"),
    [("encoder", ("src_embed.", "encoder.")), ("embeddings", ("src_embed.", "tgt_embed."))],
)
def test_frozen_parameters_stay_and_the_others_train(tmp_path, freeze, frozen) -> None:
    untied = {**TINY, "tie_embeddings": "none"}  # the output projection is not the frozen embedding
    task = TranslationTask(untied, optimizer=functools.partial(adamw, lr=1e-2), finetune={"freeze": freeze})
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(
        task, datamodule=CopyData()
    )
    after = task.model.state_dict()
    for key, value in before.items():
        unchanged = torch.equal(after[key], value)
        if key.startswith(frozen):
            assert unchanged, key
        elif key.endswith(".weight") and "positional" not in key and "norm" not in key:
            assert not unchanged, key


# --- init_from ----------------------------------------------------------------------------------------


def _trained(tmp_path) -> tuple[TranslationTask, str]:
    task = tiny_task()
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(
        task, datamodule=CopyData()
    )
    return task, _save(task, tmp_path / "trained.ckpt", data={"src_lang": "de", "tgt_lang": "en"})


def test_init_from_starts_with_the_checkpoints_validation_loss(tmp_path) -> None:
    trained, path = _trained(tmp_path)
    fresh = tiny_task(init_from=path)
    assert fresh.load_init_from(TOKENIZERS) == len(trained.model.state_dict())
    losses = []
    for task in (trained, fresh):
        (result,) = cpu_trainer(tmp_path).validate(task, datamodule=CopyData(), verbose=False)
        losses.append(result["val/loss"])
    assert losses[0] == losses[1]
    assert tiny_task().load_init_from() == 0  # no init_from: nothing


def test_init_from_of_a_lora_run_starts_from_its_merged_weights(tmp_path) -> None:
    lora = tiny_task(finetune={"lora": {"rank": RANK}})
    lora.apply_finetune()
    randomize_adapters(lora.model)
    path = _save(lora, tmp_path / "lora.ckpt")
    fresh = tiny_task(init_from=path)
    fresh.load_init_from(TOKENIZERS)
    batch = copy_batch()
    torch.testing.assert_close(logits_of(fresh.model, batch), logits_of(lora.model, batch), atol=1e-6, rtol=0)


def test_init_from_refuses_another_task_shape_or_tokenizer(tmp_path) -> None:
    _, path = _trained(tmp_path)
    with pytest.raises(CheckpointError, match="another tokenizer"):
        tiny_task(init_from=path).load_init_from({"joint": "{}"})
    wider = Seq2SeqTransformer(TransformerConfig.from_dict({**TINY, "d_ff": 32}))
    with pytest.raises(CheckpointError, match=r"its weights do not fit model\.config"):
        load_pretrained_translation(wider, path)
    classifier = _save(tiny_task(ClassificationTask), tmp_path / "classifier.ckpt")
    with pytest.raises(CheckpointError, match="is a classification checkpoint: a translation run starts"):
        load_pretrained_translation(Seq2SeqTransformer(TransformerConfig.from_dict(TINY)), classifier)
    with pytest.raises(CheckpointError, match="is a translation checkpoint: a classification run starts"):
        tiny_task(ClassificationTask, init_from=path).load_init_from()


def _cfg(path: str, **data) -> DictConfig:
    return OmegaConf.create(
        {
            "ckpt_path": None,
            "model": {"_target_": "transformer.training.TranslationTask", "init_from": path,
                      "config": {"d_model": 512, "n_heads": 8, "dropout": 0.3}},
            "data": {"src_lang": "de", "tgt_lang": "en", "max_len": 16, **data},
        }
    )  # fmt: skip


def test_the_run_takes_the_checkpoints_config_and_tokenizer(tmp_path) -> None:
    _, path = _trained(tmp_path)
    cfg = _cfg(path)
    assert take_init_from(cfg, None, {"model.config.dropout"}) == {"tokenizers": TOKENIZERS}
    # the experiment's shape gives way to the checkpoint's; dropout is the run's own
    assert OmegaConf.to_container(cfg.model.config) == {**TINY, "dropout": 0.3}
    resumed = {"hyper_parameters": {"config": {**TINY, "d_model": 64, "n_heads": 4}}}
    cfg = _cfg(path="/no/such/file")
    cfg.ckpt_path = "run/last.ckpt"
    assert take_init_from(cfg, resumed, set()) is None  # resuming: init_from is not read again
    assert cfg.model.config.d_model == 64


@pytest.mark.parametrize(
    ("data", "explicit", "message"),
    [
        ({"src_lang": "fr"}, set(), r"^data\.src_lang=fr but model\.init_from=\S+ translates de -> en"),
        (
            {},
            {"model.config.d_model"},
            r"^model\.config\.d_model=512 contradicts model\.init_from=\S+ \(32\)",
        ),
        ({"max_len": 64}, set(), r"^data\.max_len \(64\) exceeds the max_len of model\.init_from"),
    ],
)
def test_what_contradicts_the_checkpoint_is_one_line_naming_the_key(
    tmp_path, data, explicit, message
) -> None:
    _, path = _trained(tmp_path)
    with pytest.raises(ConfigError, match=message) as refused:
        take_init_from(_cfg(path, **data), None, explicit)
    assert "\n" not in str(refused.value)


def test_a_classification_checkpoint_is_refused_for_translation_in_one_line(tmp_path) -> None:
    classifier = _save(tiny_task(ClassificationTask), tmp_path / "classifier.ckpt")
    with pytest.raises(ConfigError, match="is a classification checkpoint: a translation run starts from"):
        take_init_from(_cfg(classifier), None, set())


# --- init_from of a classification checkpoint (trained here, or an imported BERT) ---------------------


def _classifier_checkpoint(tmp_path, **kwargs) -> tuple[ClassificationTask, str]:
    task = tiny_task(ClassificationTask, pooling="max", **kwargs)
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(
        task, datamodule=CopyData(classify=True)
    )
    return task, _save(task, tmp_path / "classifier.ckpt")


def test_a_classifier_starts_from_a_classification_checkpoint_with_its_head(tmp_path) -> None:
    trained, path = _classifier_checkpoint(tmp_path)
    fresh = tiny_task(ClassificationTask, pooling="max", init_from=path)
    assert fresh.load_init_from(TOKENIZERS) == len(trained.model.state_dict())
    results = [
        cpu_trainer(tmp_path).validate(task, datamodule=CopyData(classify=True), verbose=False)[0]
        for task in (trained, fresh)
    ]
    assert results[0]["val/loss"] == results[1]["val/loss"]
    three = ClassificationTask({**TINY, "n_decoder_layers": 0}, num_classes=3, pooling="max", init_from=path)
    head = {k: v.clone() for k, v in three.model.head.state_dict().items()}
    assert three.load_init_from(TOKENIZERS) == len(trained.model.state_dict()) - 2  # a new head for 3 classes
    assert all(torch.equal(three.model.head.state_dict()[k], v) for k, v in head.items())
    assert torch.equal(
        three.model.state_dict()["encoder.layers.0.norm1.weight"],
        trained.model.state_dict()["encoder.layers.0.norm1.weight"],
    )


def test_a_classification_run_takes_the_checkpoints_config_pooling_and_tokenizer(tmp_path) -> None:
    _, path = _classifier_checkpoint(tmp_path)
    cfg = OmegaConf.create(
        {"ckpt_path": None, "data": {"max_len": 16},
         "model": {"_target_": "transformer.training.ClassificationTask", "init_from": path, "pooling": "cls",
                   "config": {"d_model": 256, "dropout": 0.2}}}
    )  # fmt: skip
    assert take_init_from(cfg, None, set()) == {"tokenizers": TOKENIZERS}
    assert cfg.model.pooling == "max" and cfg.model.config.d_model == D and cfg.model.config.dropout == 0.2
    cfg.model.pooling = "cls"
    with pytest.raises(ConfigError, match=r"^model\.pooling=cls contradicts model\.init_from="):
        take_init_from(cfg, None, {"model.pooling"})


def test_adversarial_training_works_with_frozen_embeddings(tmp_path) -> None:
    """The perturbation needs the gradient w.r.t. the looked-up embeddings, which a frozen table lacks."""
    task = tiny_task(ClassificationTask, adversarial=0.1, finetune={"freeze": "embeddings"})
    before = task.model.src_embed.embedding.weight.clone()
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=0).fit(
        task, datamodule=CopyData(classify=True)
    )
    assert torch.equal(task.model.src_embed.embedding.weight, before)


def test_averaging_the_checkpoints_of_a_lora_run_is_refused(tmp_path) -> None:
    """The mean of B A over checkpoints is not the product of the mean B and the mean A."""
    from transformer.cli.evaluate_steps import load_checkpoints

    task = tiny_task(finetune={"lora": {"rank": RANK}})
    task.apply_finetune()
    for step in (1, 2):
        checkpoint = {
            "state_dict": task.state_dict(),
            "hyper_parameters": dict(task.hparams),
            "global_step": step,
        }
        torch.save(checkpoint, tmp_path / f"epoch_{step}.ckpt")
    cfg = OmegaConf.create({"average_last": 2})
    with pytest.raises(ConfigError, match=r"^average_last=2: \S+ is a LoRA fine-tuning checkpoint"):
        load_checkpoints(cfg, tmp_path)


def test_the_keys_given_on_the_command_line_are_read_from_hydras_overrides() -> None:
    overrides = [
        "experiment=multi30k_de_en",
        "model.config.d_model=64",
        "+model.config.x=1",
        "~model.pooling",
    ]
    assert explicit_keys(overrides) == {
        "experiment",
        "model.config.d_model",
        "model.config.x",
        "model.pooling",
    }


def test_finetune_lora_with_rank_0_is_refused_naming_both() -> None:
    """rank 0 means "no adapters": with finetune=lora chosen it would train every weight without a word."""
    from tests.helpers.configs import compose_train_cfg
    from transformer.cli.build import finetune_argument
    from transformer.cli.errors import ConfigError

    cfg = compose_train_cfg(["finetune=lora", "finetune.lora.rank=0"])
    with pytest.raises(
        ConfigError, match=r"^finetune=lora with finetune\.lora\.rank=0: rank 0 means no adapters"
    ):
        finetune_argument(cfg)
    assert (
        finetune_argument(compose_train_cfg(["finetune=lora", "finetune.lora.rank=2"]))["finetune"]["lora"][
            "rank"
        ]
        == 2
    )
    assert finetune_argument(compose_train_cfg(["finetune.lora.rank=0"]))["finetune"]["lora"]["rank"] == 0


@pytest.mark.parametrize("config", [{}, None, 5])
def test_init_from_takes_the_config_into_an_empty_or_missing_node(tmp_path, config) -> None:
    """`model.config={}` (or no node) is filled with the checkpoint's; it was OmegaConf's raw ValueError."""
    _, path = _trained(tmp_path)
    cfg = _cfg(path)
    cfg.model.config = config
    if config == 5:
        with pytest.raises(ConfigError, match=r"^model\.config must be a mapping"):
            take_init_from(cfg, None, set())
        return
    assert take_init_from(cfg, None, set()) == {"tokenizers": TOKENIZERS}
    assert OmegaConf.to_container(cfg.model.config) == TINY


# --- init_from's fit checks at their exact boundaries -------------------------------------------------


def _untrained(tmp_path, cls=TranslationTask, **kwargs) -> str:
    """A checkpoint as train.py writes one, of a fresh task (the checks read shapes, not values)."""
    task = tiny_task(cls, **kwargs)
    data = {"src_lang": "de", "tgt_lang": "en"} if cls is TranslationTask else None
    return _save(task, tmp_path / f"{cls.__name__}.ckpt", data=data)


def test_data_max_len_may_equal_the_checkpoints_not_exceed_it_by_one(tmp_path) -> None:
    path = _untrained(tmp_path)
    assert take_init_from(_cfg(path, max_len=TINY["max_len"]), None, set()) == {"tokenizers": TOKENIZERS}
    with pytest.raises(ConfigError, match=rf"^data\.max_len \({TINY['max_len'] + 1}\) exceeds the max_len"):
        take_init_from(_cfg(path, max_len=TINY["max_len"] + 1), None, set())
    resumed = {"hyper_parameters": {"config": dict(TINY)}}  # resuming checks the resumed run's max_len
    cfg = _cfg("/no/such/file", max_len=TINY["max_len"] + 1)
    cfg.ckpt_path = "run/last.ckpt"
    with pytest.raises(ConfigError, match=r"^data\.max_len \(33\) exceeds the max_len of ckpt_path=run/last"):
        take_init_from(cfg, resumed, set())


def test_a_model_config_key_given_equal_to_the_checkpoints_is_no_contradiction(tmp_path) -> None:
    path = _untrained(tmp_path)
    cfg = _cfg(path)
    cfg.model.config.d_model = D
    take_init_from(cfg, None, {"model.config.d_model", "model.config.dropout"})
    assert cfg.model.config.d_model == D and cfg.model.config.dropout == 0.3
    cfg = _cfg(path)
    cfg.model.config.d_model = D + 1
    with pytest.raises(ConfigError, match=rf"^model\.config\.d_model={D + 1} contradicts"):
        take_init_from(cfg, None, {"model.config.d_model"})
    cfg = _cfg(path)
    cfg.model.config.not_a_key = 1  # a key the checkpoint's config lacks contradicts it too
    with pytest.raises(ConfigError, match=r"^model\.config\.not_a_key=1 contradicts \S+ \(None\)"):
        take_init_from(cfg, None, {"model.config.not_a_key"})


def test_languages_equal_to_the_checkpoints_pass_and_each_side_is_checked(tmp_path) -> None:
    path = _untrained(tmp_path)
    take_init_from(_cfg(path, src_lang="de", tgt_lang="en"), None, set())
    with pytest.raises(ConfigError, match=r"^data\.tgt_lang=fr but \S+ translates de -> en"):
        take_init_from(_cfg(path, tgt_lang="fr"), None, set())
    with pytest.raises(ConfigError, match=r"^data\.src_lang=en data\.tgt_lang=de but"):
        take_init_from(_cfg(path, src_lang="en", tgt_lang="de"), None, set())
    unnamed = _save(tiny_task(), tmp_path / "unnamed.ckpt", data={"src_lang": "src", "tgt_lang": "tgt"})
    take_init_from(_cfg(unnamed, src_lang="fr", tgt_lang="it"), None, set())  # an import naming none


@pytest.mark.parametrize("change", [{"src_vocab_size": 1}, {"src_vocab_size": -1}, {"max_len": 1}])
def test_a_translation_model_one_off_the_checkpoints_vocabulary_or_positions_is_refused(
    tmp_path, change
) -> None:
    base = {**TINY, "positional": "learned"}  # learned positions: max_len is a weight's shape
    path = _save(TranslationTask(base), tmp_path / "learned.ckpt", data={"src_lang": "de", "tgt_lang": "en"})
    same = Seq2SeqTransformer(TransformerConfig.from_dict(base))
    assert load_pretrained_translation(same, path, TOKENIZERS) == len(same.state_dict())
    key, step = next(iter(change.items()))
    other = Seq2SeqTransformer(TransformerConfig.from_dict({**base, key: base[key] + step}))
    with pytest.raises(CheckpointError, match=r"its weights do not fit model\.config \(\S+ has shape"):
        load_pretrained_translation(other, path)


@pytest.mark.parametrize(("saved", "run"), [(2, 2), (3, 3), (2, 3), (3, 2)])
def test_the_head_is_kept_exactly_when_the_class_counts_are_equal(tmp_path, saved, run) -> None:
    from transformer.evaluation.init_from import load_pretrained_classifier

    encoder_only = {**TINY, "n_decoder_layers": 0}
    source = ClassificationTask(encoder_only, num_classes=saved)
    path = _save(source, tmp_path / "classifier.ckpt")
    torch.manual_seed(1)  # another draw than the source's: a kept head differs from a new one
    model = ClassificationTask(encoder_only, num_classes=run).model
    fresh_head = {k: v.clone() for k, v in model.head.state_dict().items()}
    n, what = load_pretrained_classifier(model, path, TOKENIZERS)
    total = len(source.model.state_dict())
    for key, value in source.model.state_dict().items():
        if not key.startswith("head."):
            assert torch.equal(model.state_dict()[key], value), key
    kept = source.model.head.state_dict() if saved == run else fresh_head
    assert all(torch.equal(model.head.state_dict()[k], v) for k, v in kept.items())
    assert n == (total if saved == run else total - 2)
    assert ("kept" in what) == (saved == run) and ("new" in what) == (saved != run), what
    with pytest.raises(CheckpointError, match="another tokenizer"):
        load_pretrained_classifier(model, path, {"joint": "{}"})


def test_finetune_freeze_null_is_none() -> None:
    """`finetune.freeze=null` (or an empty value) freezes nothing, as leaving it out does."""
    for values in ({"freeze": None}, {"freeze": ""}, {}, None):
        settings = FinetuneSettings.from_values(values)
        assert settings.freeze == "none" and settings.frozen_modules == () and not settings.active


def _masked_lm_checkpoint(tmp_path) -> str:
    path = tmp_path / "pretrained.ckpt"
    torch.save(
        {
            "state_dict": {},
            "hyper_parameters": {"config": {**TINY, "n_decoder_layers": 0}, "mask_prob": 0.15},
            "config": {"model": {"_target_": "transformer.training.MaskedLMTask"}, "data": {}},
        },
        path,
    )
    return str(path)


def test_a_masked_lm_checkpoint_starts_a_classifier_only(tmp_path) -> None:
    """A classification run takes nothing from it here (its encoder is copied later, the run's own config and
    tokenizer kept); a translation run is refused in one line."""
    path = _masked_lm_checkpoint(tmp_path)
    cfg = OmegaConf.create(
        {"ckpt_path": None, "data": {"max_len": 16},
         "model": {"_target_": "transformer.training.ClassificationTask", "init_from": path,
                   "config": {"d_model": 256}}}
    )  # fmt: skip
    assert take_init_from(cfg, None, set()) is None
    assert OmegaConf.to_container(cfg.model.config) == {"d_model": 256}
    with pytest.raises(
        ConfigError, match=r"^model\.init_from=\S+ is a masked-LM pretraining checkpoint"
    ) as refused:
        take_init_from(_cfg(path), None, set())
    assert "\n" not in str(refused.value)


def test_init_from_is_read_only_by_the_tasks_that_take_it(tmp_path) -> None:
    """Another task's `model.init_from` (none takes one) is not read: no file access, the config untouched."""
    cfg = _cfg("/no/such/file.ckpt")
    cfg.model._target_ = "transformer.training.MaskedLMTask"
    assert take_init_from(cfg, None, set()) is None
    assert cfg.model.config.d_model == 512


def test_a_checkpoint_without_its_tokenizer_is_refused_and_the_taken_config_is_logged(
    tmp_path, caplog
) -> None:
    bare = tmp_path / "bare.ckpt"
    checkpoint = torch.load(_untrained(tmp_path), weights_only=True)
    del checkpoint["TranslationDataModule"]
    torch.save(checkpoint, bare)
    with pytest.raises(ConfigError, match=r"^model\.init_from=\S+ carries no tokenizer"):
        take_init_from(_cfg(str(bare)), None, set())
    with caplog.at_level("INFO", logger="train"):
        take_init_from(_cfg(_untrained(tmp_path)), None, set())
    assert "model.config from model.init_from=" in caplog.text and f"d_model={D}" in caplog.text
    assert "dropout" not in caplog.text  # the run's own setting: not replaced


def test_masked_lm_pretraining_takes_only_a_finetune_section_that_changes_nothing() -> None:
    """`FinetuneSettings` decides what "changes nothing" means for train.py too: the defaults and rank 0
    pass (no argument for the task), a freeze or a LoRA rank is refused in one line naming the model."""
    from tests.helpers.configs import compose_train_cfg
    from transformer.cli.build import finetune_argument

    assert finetune_argument(compose_train_cfg(["model=masked_lm"])) == {}
    assert finetune_argument(compose_train_cfg(["model=masked_lm", "finetune.lora.rank=0"])) == {}
    for override in ("finetune.freeze=encoder", "finetune.lora.rank=2", "finetune.freeze=everything"):
        with pytest.raises(ConfigError, match=r"^finetune\.\* needs a translation or classification model"):
            finetune_argument(compose_train_cfg(["model=masked_lm", override]))


def test_a_checkpoint_finetune_section_is_read_by_the_same_settings_type() -> None:
    """restore reads a checkpoint's `finetune` with `FinetuneSettings`: its frozen modules and adapters, and
    a bad value as one CheckpointError naming the file and the key."""
    from transformer.evaluation.restore import finetune_settings, lora_settings

    hparams = {"finetune": {"freeze": "embeddings", "lora": {"rank": 2, "targets": ["q", "v"]}}}
    settings = finetune_settings(hparams, "run.ckpt")
    assert settings == FinetuneSettings.from_values(hparams["finetune"])
    assert settings.frozen_modules == ("src_embed", "tgt_embed")
    assert lora_settings(hparams) == LoraSettings(rank=2, targets=("q", "v"))
    assert lora_settings({"finetune": {"lora": {"rank": 0}}}) is None and lora_settings({}) is None
    with pytest.raises(CheckpointError, match=r"^checkpoint run\.ckpt: its finetune\.lora\.alpha must be"):
        lora_settings({"finetune": {"lora": {"rank": 2, "alpha": -1}}}, "run.ckpt")

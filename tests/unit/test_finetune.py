"""Fine-tuning: `model.init_from` of a translation checkpoint, `finetune.freeze`, LoRA adapters (merged =
unmerged, zero start, the trainable count, checkpoints that evaluate merged) and the refusals."""

from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from tests.helpers.tasks import TINY, CopyData, cpu_trainer
from transformer.checkpoint import CheckpointError
from transformer.cli.errors import ConfigError
from transformer.cli.init_from import explicit_keys, take_init_from
from transformer.config import TransformerConfig
from transformer.evaluation.init_from import load_pretrained_translation
from transformer.evaluation.restore import restore_model
from transformer.lora import FinetuneSettings, LoraSettings, LowRankUpdate, add_lora, merge_lora
from transformer.model import Seq2SeqTransformer
from transformer.training import ClassificationTask, TranslationTask
from transformer.training.finetune import apply_finetune, parameter_counts
from transformer.training.optim import adamw

TOKENIZERS = {"joint": '{"a tokenizer": 1}'}
D, D_FF, RANK = TINY["d_model"], TINY["d_ff"], 4


def _task(cls=TranslationTask, **kwargs):
    extra = {"num_classes": 2} if cls is ClassificationTask else {}
    config = {**TINY, "n_decoder_layers": 0} if cls is ClassificationTask else TINY
    return cls(config, optimizer=functools.partial(adamw, lr=1e-2), **extra, **kwargs)


def _batch() -> dict[str, torch.Tensor]:
    return next(iter(CopyData().val_dataloader()))


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(batch["src"], batch["tgt_in"])


def _randomize_adapters(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)


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


# --- LoRA ---------------------------------------------------------------------------------------------


def test_lora_starts_as_the_base_model_and_merges_to_the_same_outputs() -> None:
    model, batch = Seq2SeqTransformer(TransformerConfig.from_dict(TINY)), _batch()
    base = _logits(model, batch)
    add_lora(model, LoraSettings(rank=RANK, alpha=8, targets=("q", "k", "v", "o", "ff")))
    assert torch.equal(_logits(model, batch), base)  # B starts at zero: exactly the base model
    _randomize_adapters(model)
    unmerged = _logits(model, batch)
    assert (unmerged - base).abs().max() > 1e-2  # the adapters change the outputs
    assert merge_lora(model) == 3 * 2 + 2 * 2  # 3 attentions x (in_proj, out_proj), 2 layers x 2 linears
    torch.testing.assert_close(_logits(model, batch), unmerged, atol=1e-6, rtol=0)
    assert (
        model.state_dict().keys() == Seq2SeqTransformer(TransformerConfig.from_dict(TINY)).state_dict().keys()
    )


def test_lora_updates_only_the_rows_of_its_targets() -> None:
    model = Seq2SeqTransformer(TransformerConfig.from_dict(TINY))
    before = model.encoder.layers[0].self_attn.in_proj_weight.detach().clone()
    add_lora(model, LoraSettings(rank=RANK, targets=("k",)))
    _randomize_adapters(model)
    after = model.encoder.layers[0].self_attn.in_proj_weight.detach()
    assert torch.equal(after[:D], before[:D]) and torch.equal(after[2 * D :], before[2 * D :])  # q, v
    assert not torch.equal(after[D : 2 * D], before[D : 2 * D])  # k
    assert not any("out_proj.parametrizations" in n for n, _ in model.named_parameters())


def test_rank_dropout_drops_whole_components_and_keeps_the_expectation() -> None:
    """In training, each draw is scale * B diag(m) A with m_i in {0, 1 / (1 - p)}: whole rank-one components
    dropped, the rest scaled, so the mean over draws is the update itself; in eval, the update."""
    update = LowRankUpdate(torch.zeros(6, 5), {"q": (0, 6)}, rank=2, scale=1.5, dropout=0.5)
    with torch.no_grad():
        update.lora_B["q"].normal_()
    B, A = update.lora_B["q"].detach(), update.lora_A["q"].detach()
    one, two = (1.5 * torch.outer(B[:, i], A[i]) for i in range(2))
    allowed = [torch.zeros(6, 5), 2 * one, 2 * two, 2 * (one + two)]  # 1 / (1 - p) = 2
    torch.manual_seed(0)
    with torch.no_grad():
        draws = [update.delta() for _ in range(400)]
        for draw in draws:
            assert any(torch.allclose(draw, a, atol=1e-5) for a in allowed)
        mean = torch.stack(draws).mean(0)
        torch.testing.assert_close(mean, one + two, atol=0.25 * float((one + two).abs().max()), rtol=0)
        update.eval()
        torch.testing.assert_close(update.delta(), one + two)


def test_lora_adapts_the_gate_of_a_gated_feed_forward() -> None:
    model = Seq2SeqTransformer(TransformerConfig.from_dict({**TINY, "activation": "swiglu"}))
    names = add_lora(model, LoraSettings(rank=RANK, targets=("ff",)))
    assert sorted({name.rsplit(".", 2)[-2] for name in names}) == ["gate", "linear1", "linear2"]
    assert len(names) == 3 * 2  # two layers


def test_merging_a_model_left_in_training_mode_takes_no_dropout() -> None:
    model, batch = Seq2SeqTransformer(TransformerConfig.from_dict(TINY)), _batch()
    add_lora(model, LoraSettings(rank=RANK, dropout=0.5, targets=("q", "v")))
    _randomize_adapters(model)
    unmerged = _logits(model, batch)  # eval: no rank dropout
    model.train()
    merge_lora(model)
    torch.testing.assert_close(_logits(model, batch), unmerged, atol=1e-6, rtol=0)


def _expected_trainable(n_attentions: int, n_layers: int, targets: tuple[str, ...]) -> int:
    """Each adapted (rows x columns) block trains A (rank x columns) and B (rows x rank)."""
    per_attention = sum(2 * RANK * D for t in ("q", "k", "v", "o") if t in targets)
    per_layer = 2 * RANK * (D + D_FF) if "ff" in targets else 0  # linear1 (D_FF x D), linear2 (D x D_FF)
    return n_attentions * per_attention + n_layers * per_layer


@pytest.mark.parametrize("targets", [("q", "k", "v", "o"), ("q", "v", "ff")])
def test_lora_trains_exactly_the_adapters_and_says_how_many(targets) -> None:
    task = _task()
    n_base = parameter_counts(task.model)[1]
    message = apply_finetune(
        task.model, FinetuneSettings.from_values({"lora": {"rank": RANK, "targets": list(targets)}})
    )
    expected = _expected_trainable(n_attentions=3, n_layers=2, targets=targets)
    assert message.startswith(f"LoRA: {expected} trainable of {n_base + expected} parameters")
    assert parameter_counts(task.model) == (expected, n_base + expected)
    trainable = {n for n, p in task.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_lora_of_a_classifier_trains_its_new_head_too_and_not_a_frozen_encoder() -> None:
    task = _task(ClassificationTask, finetune={"lora": {"rank": RANK}})
    head = sum(p.numel() for p in task.model.head.parameters())
    n_base = parameter_counts(task.model)[1]
    task.apply_finetune()
    expected = _expected_trainable(n_attentions=1, n_layers=1, targets=("q", "k", "v", "o")) + head
    assert parameter_counts(task.model) == (expected, n_base + expected - head)
    # a classifier's projections are all in its encoder: LoRA would adapt nothing, so it is refused
    with pytest.raises(ValueError, match=r"are all in what finetune\.freeze=encoder freezes") as refused:
        _task(ClassificationTask, finetune={"freeze": "encoder", "lora": {"rank": RANK}})
    assert "\n" not in str(refused.value)
    frozen = _task(ClassificationTask, finetune={"freeze": "encoder"})  # the head alone, as it says
    frozen.apply_finetune()
    assert parameter_counts(frozen.model)[0] == head


def test_a_rank_larger_than_a_projection_is_refused_naming_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"finetune\.lora\.rank=65 is larger than the ff projection .* at most 32"
    ):
        _task(finetune={"lora": {"rank": 65, "targets": ["ff"]}})
    with pytest.raises(
        ValueError, match=r"finetune\.lora\.rank=40 is larger than the ff projection .* at most 32"
    ):
        _task(finetune={"lora": {"rank": 40, "targets": ["ff"]}})  # linear1 (64 x 32): its 32 columns
    with pytest.raises(ValueError, match=r"finetune\.lora\.rank=33 is larger than the q projection"):
        _task(finetune={"lora": {"rank": 33, "targets": ["q"]}})
    for bad, key in (
        ({"freeze": "decoder"}, "finetune.freeze"),
        ({"lora": {"rank": 2, "targets": ["x"]}}, "lora.targets"),
    ):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            FinetuneSettings.from_values(bad)


def test_lora_training_changes_only_the_adapters_and_its_checkpoint_evaluates_merged(tmp_path) -> None:
    task = _task(finetune={"lora": {"rank": RANK, "targets": ["q", "k", "v", "o", "ff"]}})
    base = {k: v.clone() for k, v in task.model.state_dict().items()}
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=4, limit_val_batches=1)
    trainer.fit(task, datamodule=CopyData())
    state = task.model.state_dict()
    adapters = [k for k in state if ".lora_" in k]
    assert adapters and all(
        not torch.equal(state[k], torch.zeros_like(state[k])) for k in adapters if "lora_B" in k
    )
    for key, value in base.items():  # every base weight as it was (a parametrized one: its `original`)
        module, _, name = key.rpartition(".")
        assert torch.equal(state.get(key, state.get(f"{module}.parametrizations.{name}.original")), value), (
            key
        )
    path = tmp_path / "lora.ckpt"
    trainer.save_checkpoint(path)
    restored = restore_model(torch.load(path, weights_only=True), path)  # what evaluate.py / export use
    assert not any("parametrizations" in k for k in restored.model.state_dict())
    batch = _batch()
    torch.testing.assert_close(_logits(restored.model, batch), _logits(task.model, batch), atol=1e-6, rtol=0)
    resumed = _task(finetune=dict(task.hparams.finetune))  # resume: the same layout, then the state
    resumed.apply_finetune()
    resumed.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    assert torch.equal(_logits(resumed.model, batch), _logits(task.model, batch))


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
    task = _task()
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(
        task, datamodule=CopyData()
    )
    return task, _save(task, tmp_path / "trained.ckpt", data={"src_lang": "de", "tgt_lang": "en"})


def test_init_from_starts_with_the_checkpoints_validation_loss(tmp_path) -> None:
    trained, path = _trained(tmp_path)
    fresh = _task(init_from=path)
    assert fresh.load_init_from(TOKENIZERS) == len(trained.model.state_dict())
    losses = []
    for task in (trained, fresh):
        (result,) = cpu_trainer(tmp_path).validate(task, datamodule=CopyData(), verbose=False)
        losses.append(result["val/loss"])
    assert losses[0] == losses[1]
    assert _task().load_init_from() == 0  # no init_from: nothing


def test_init_from_of_a_lora_run_starts_from_its_merged_weights(tmp_path) -> None:
    lora = _task(finetune={"lora": {"rank": RANK}})
    lora.apply_finetune()
    _randomize_adapters(lora.model)
    path = _save(lora, tmp_path / "lora.ckpt")
    fresh = _task(init_from=path)
    fresh.load_init_from(TOKENIZERS)
    batch = _batch()
    torch.testing.assert_close(_logits(fresh.model, batch), _logits(lora.model, batch), atol=1e-6, rtol=0)


def test_init_from_refuses_another_task_shape_or_tokenizer(tmp_path) -> None:
    _, path = _trained(tmp_path)
    with pytest.raises(CheckpointError, match="another tokenizer"):
        _task(init_from=path).load_init_from({"joint": "{}"})
    wider = Seq2SeqTransformer(TransformerConfig.from_dict({**TINY, "d_ff": 32}))
    with pytest.raises(CheckpointError, match=r"its weights do not fit model\.config"):
        load_pretrained_translation(wider, path)
    classifier = _save(_task(ClassificationTask), tmp_path / "classifier.ckpt")
    with pytest.raises(CheckpointError, match="is a classification checkpoint: a translation run starts"):
        load_pretrained_translation(Seq2SeqTransformer(TransformerConfig.from_dict(TINY)), classifier)
    with pytest.raises(CheckpointError, match="is a translation checkpoint: a classification run starts"):
        _task(ClassificationTask, init_from=path).load_init_from()


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
    assert take_init_from(cfg, None, {"model.config.dropout"}) == TOKENIZERS
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
    classifier = _save(_task(ClassificationTask), tmp_path / "classifier.ckpt")
    with pytest.raises(ConfigError, match="is a classification checkpoint: a translation run starts from"):
        take_init_from(_cfg(classifier), None, set())


# --- init_from of a classification checkpoint (trained here, or an imported BERT) ---------------------


def _classifier_checkpoint(tmp_path, **kwargs) -> tuple[ClassificationTask, str]:
    task = _task(ClassificationTask, pooling="max", **kwargs)
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(
        task, datamodule=CopyData(classify=True)
    )
    return task, _save(task, tmp_path / "classifier.ckpt")


def test_a_classifier_starts_from_a_classification_checkpoint_with_its_head(tmp_path) -> None:
    trained, path = _classifier_checkpoint(tmp_path)
    fresh = _task(ClassificationTask, pooling="max", init_from=path)
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
    assert take_init_from(cfg, None, set()) == TOKENIZERS
    assert cfg.model.pooling == "max" and cfg.model.config.d_model == D and cfg.model.config.dropout == 0.2
    cfg.model.pooling = "cls"
    with pytest.raises(ConfigError, match=r"^model\.pooling=cls contradicts model\.init_from="):
        take_init_from(cfg, None, {"model.pooling"})


def test_adversarial_training_works_with_frozen_embeddings(tmp_path) -> None:
    """The perturbation needs the gradient w.r.t. the looked-up embeddings, which a frozen table lacks."""
    task = _task(ClassificationTask, adversarial=0.1, finetune={"freeze": "embeddings"})
    before = task.model.src_embed.embedding.weight.clone()
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=0).fit(
        task, datamodule=CopyData(classify=True)
    )
    assert torch.equal(task.model.src_embed.embedding.weight, before)


def test_averaging_the_checkpoints_of_a_lora_run_is_refused(tmp_path) -> None:
    """The mean of B A over checkpoints is not the product of the mean B and the mean A."""
    from transformer.cli.evaluate_steps import load_checkpoints

    task = _task(finetune={"lora": {"rank": RANK}})
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
    assert take_init_from(cfg, None, set()) == TOKENIZERS
    assert OmegaConf.to_container(cfg.model.config) == TINY


# --- LoRA's numbers: the scale alpha / rank, the rows each target owns, the bounds of the settings -----


def _delta(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The parametrized weight minus its original: what the adapters add."""
    with torch.no_grad():
        return getattr(module, name) - module.parametrizations[name].original


@pytest.mark.parametrize(("rank", "alpha"), [(1, 16.0), (2, 3.0), (4, 8.0), (8, 2.0)])
def test_the_update_is_alpha_over_rank_times_b_a_in_its_own_rows(rank: int, alpha: float) -> None:
    """W + (alpha / r) B A, by hand, for each of q, k, v (its D rows of in_proj), o and the feed-forward;
    alpha, alpha * r or r / alpha as the scale would fail some of the (rank, alpha) pairs."""
    model = Seq2SeqTransformer(TransformerConfig.from_dict(TINY))
    settings = LoraSettings(rank=rank, alpha=alpha, targets=("q", "k", "v", "o", "ff"))
    assert settings.scale == alpha / rank
    add_lora(model, settings)
    _randomize_adapters(model)
    attention = model.encoder.layers[0].self_attn
    update = attention.parametrizations["in_proj_weight"][0]
    delta = _delta(attention, "in_proj_weight")  # (3D, D)
    for i, part in enumerate("qkv"):
        B, A = update.lora_B[part].detach(), update.lora_A[part].detach()
        assert B.shape == (D, rank) and A.shape == (rank, D)
        torch.testing.assert_close(delta[i * D : (i + 1) * D], alpha / rank * B @ A, rtol=1e-5, atol=1e-6)
    for module, rows, columns in (
        (attention.out_proj, D, D),
        (model.encoder.layers[0].feed_forward.linear1, D_FF, D),
        (model.encoder.layers[0].feed_forward.linear2, D, D_FF),
    ):
        update = module.parametrizations["weight"][0]
        (part,) = update.lora_B.keys()
        B, A = update.lora_B[part].detach(), update.lora_A[part].detach()
        assert B.shape == (rows, rank) and A.shape == (rank, columns)
        torch.testing.assert_close(_delta(module, "weight"), alpha / rank * B @ A, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("targets", [("q",), ("v",), ("q", "v"), ("k", "v")])
def test_each_attention_target_changes_exactly_its_rows(targets: tuple[str, ...]) -> None:
    model = Seq2SeqTransformer(TransformerConfig.from_dict(TINY))
    add_lora(model, LoraSettings(rank=RANK, targets=targets))
    _randomize_adapters(model)
    for attention in (model.encoder.layers[0].self_attn, model.decoder.layers[0].cross_attn):
        changed = _delta(attention, "in_proj_weight").ne(0).any(dim=1)  # (3D,) rows that moved
        expected = torch.zeros(3 * D, dtype=torch.bool)
        for part in targets:
            start = "qkv".index(part) * D
            expected[start : start + D] = True
        assert torch.equal(changed, expected), targets


def test_rank_dropout_keeps_the_expectation_with_the_scale_and_drops_nothing_at_zero() -> None:
    """With dropout 0 a training-mode update is the update (no draw at all); with dropout p the kept
    components are scaled by 1 / (1 - p), on top of alpha / r."""
    torch.manual_seed(3)
    plain = LowRankUpdate(torch.zeros(4, 3), {"q": (0, 4)}, rank=2, scale=0.75, dropout=0.0).train()
    with torch.no_grad():
        plain.lora_B["q"].normal_()
        expected = 0.75 * plain.lora_B["q"] @ plain.lora_A["q"]
        state = torch.random.get_rng_state()
        torch.testing.assert_close(plain.delta(), expected)
        assert torch.equal(torch.random.get_rng_state(), state)  # no random draw without dropout
    dropped = LowRankUpdate(torch.zeros(4, 3), {"q": (0, 4)}, rank=1, scale=0.75, dropout=0.25).train()
    with torch.no_grad():
        dropped.lora_B["q"].normal_()
        one = 0.75 * dropped.lora_B["q"] @ dropped.lora_A["q"]
        draws = {round(float((dropped.delta() / one).nanmean()), 5) for _ in range(60)}
    assert draws == {0.0, round(1 / 0.75, 5)}


def test_a_rank_as_large_as_the_projection_allows_is_taken() -> None:
    """The bound is min(rows, columns), inclusive: rank D on q (D x D), D on ff (linear1 is D_FF x D)."""
    for targets in (["q"], ["ff"], ["o"]):
        task = _task(finetune={"lora": {"rank": D, "targets": targets}})
        task.apply_finetune()
        assert any(".lora_A." in name for name, _ in task.model.named_parameters())
        with pytest.raises(ValueError, match=rf"finetune\.lora\.rank={D + 1} is larger than"):
            _task(finetune={"lora": {"rank": D + 1, "targets": targets}})


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"rank": 0}, "lora.rank"),
        ({"rank": -1}, "lora.rank"),
        ({"rank": 2.0}, "lora.rank"),
        ({"rank": True}, "lora.rank"),
        ({"rank": 1, "alpha": 0}, "lora.alpha"),
        ({"rank": 1, "alpha": -1.0}, "lora.alpha"),
        ({"rank": 1, "alpha": float("inf")}, "lora.alpha"),
        ({"rank": 1, "dropout": 1.0}, "lora.dropout"),
        ({"rank": 1, "dropout": -0.01}, "lora.dropout"),
        ({"rank": 1, "targets": []}, "lora.targets"),
        ({"rank": 1, "targets": ["q", "q"]}, "lora.targets"),
        ({"rank": 1, "targets": "q"}, "lora.targets"),
        ({"rank": 1, "scale": 2}, "no setting 'scale'"),
    ],
)
def test_lora_settings_are_refused_just_past_their_bounds(values: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        LoraSettings.from_dict(values)


def test_lora_settings_at_their_bounds_are_taken() -> None:
    settings = LoraSettings.from_dict({"rank": 1, "alpha": 1e-6, "dropout": 0.0, "targets": ["ff"]})
    assert (settings.rank, settings.scale, settings.targets) == (1, 1e-6, ("ff",))
    assert LoraSettings.from_dict({"rank": 3, "dropout": 0.999}).dropout == 0.999
    default = LoraSettings.from_dict({"rank": 4})
    assert (default.alpha, default.scale, default.dropout, default.targets) == (
        16.0,
        4.0,
        0.0,
        ("q", "k", "v", "o"),
    )
    assert LoraSettings.from_dict(default.to_dict()) == default  # a checkpoint's hparams round trip
    assert FinetuneSettings.from_values({"lora": {"rank": 0}}).lora is None  # rank 0: no adapters
    assert FinetuneSettings.from_values({"lora": {"rank": 1}}).lora == LoraSettings(rank=1)
    assert (
        not FinetuneSettings.from_values(None).active
        and FinetuneSettings.from_values({"freeze": "embeddings"}).active
    )


# --- init_from's fit checks at their exact boundaries -------------------------------------------------


def _untrained(tmp_path, cls=TranslationTask, **kwargs) -> str:
    """A checkpoint as train.py writes one, of a fresh task (the checks read shapes, not values)."""
    task = _task(cls, **kwargs)
    data = {"src_lang": "de", "tgt_lang": "en"} if cls is TranslationTask else None
    return _save(task, tmp_path / f"{cls.__name__}.ckpt", data=data)


def test_data_max_len_may_equal_the_checkpoints_not_exceed_it_by_one(tmp_path) -> None:
    path = _untrained(tmp_path)
    assert take_init_from(_cfg(path, max_len=TINY["max_len"]), None, set()) == TOKENIZERS
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
    unnamed = _save(_task(), tmp_path / "unnamed.ckpt", data={"src_lang": "src", "tgt_lang": "tgt"})
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


# --- what the mutation survey found untested ------------------------------------------------------------


def test_the_adapters_a_starts_as_pefts_kaiming_uniform_and_b_at_zero() -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a = sqrt(5), as PEFT and nn.Linear), B = 0."""
    torch.manual_seed(0)
    update = LowRankUpdate(torch.zeros(D_FF, D), {"ff": (0, D_FF)}, rank=8, scale=2.0, dropout=0.0)
    A, B = update.lora_A["ff"].detach(), update.lora_B["ff"].detach()
    bound = 1 / D**0.5
    assert A.abs().max() <= bound and A.abs().max() > 0.9 * bound  # 256 draws reach near the bound
    assert abs(A.std().item() - bound / 3**0.5) < 0.15 * bound
    assert B.shape == (D_FF, 8) and not B.any()


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

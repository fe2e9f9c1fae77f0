"""LoRA adapters: they start as the base model and merge to the same outputs, update only their targets'
rows (the scale alpha / rank, each attention target its own rows), rank dropout keeps the expectation,
the trainable count, a classifier's new head, refusals at and past the settings' bounds, a LoRA run's
checkpoint evaluates merged, and the adapters' initialization (PEFT's)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.finetune import D_FF, RANK, D, copy_batch, logits_of, randomize_adapters, tiny_task
from tests.helpers.tasks import TINY, CopyData, cpu_trainer
from transformer.config import TransformerConfig
from transformer.evaluation.restore import restore_model
from transformer.lora import FinetuneSettings, LoraSettings, LowRankUpdate, add_lora, merge_lora
from transformer.model import Seq2SeqTransformer
from transformer.training import ClassificationTask
from transformer.training.finetune import apply_finetune, parameter_counts

# --- LoRA ---------------------------------------------------------------------------------------------


def test_lora_starts_as_the_base_model_and_merges_to_the_same_outputs() -> None:
    model, batch = Seq2SeqTransformer(TransformerConfig.from_dict(TINY)), copy_batch()
    base = logits_of(model, batch)
    add_lora(model, LoraSettings(rank=RANK, alpha=8, targets=("q", "k", "v", "o", "ff")))
    assert torch.equal(logits_of(model, batch), base)  # B starts at zero: exactly the base model
    randomize_adapters(model)
    unmerged = logits_of(model, batch)
    assert (unmerged - base).abs().max() > 1e-2  # the adapters change the outputs
    assert merge_lora(model) == 3 * 2 + 2 * 2  # 3 attentions x (in_proj, out_proj), 2 layers x 2 linears
    torch.testing.assert_close(logits_of(model, batch), unmerged, atol=1e-6, rtol=0)
    assert (
        model.state_dict().keys() == Seq2SeqTransformer(TransformerConfig.from_dict(TINY)).state_dict().keys()
    )


def test_lora_updates_only_the_rows_of_its_targets() -> None:
    model = Seq2SeqTransformer(TransformerConfig.from_dict(TINY))
    before = model.encoder.layers[0].self_attn.in_proj_weight.detach().clone()
    add_lora(model, LoraSettings(rank=RANK, targets=("k",)))
    randomize_adapters(model)
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
    model, batch = Seq2SeqTransformer(TransformerConfig.from_dict(TINY)), copy_batch()
    add_lora(model, LoraSettings(rank=RANK, dropout=0.5, targets=("q", "v")))
    randomize_adapters(model)
    unmerged = logits_of(model, batch)  # eval: no rank dropout
    model.train()
    merge_lora(model)
    torch.testing.assert_close(logits_of(model, batch), unmerged, atol=1e-6, rtol=0)


def _expected_trainable(n_attentions: int, n_layers: int, targets: tuple[str, ...]) -> int:
    """Each adapted (rows x columns) block trains A (rank x columns) and B (rows x rank)."""
    per_attention = sum(2 * RANK * D for t in ("q", "k", "v", "o") if t in targets)
    per_layer = 2 * RANK * (D + D_FF) if "ff" in targets else 0  # linear1 (D_FF x D), linear2 (D x D_FF)
    return n_attentions * per_attention + n_layers * per_layer


@pytest.mark.parametrize("targets", [("q", "k", "v", "o"), ("q", "v", "ff")])
def test_lora_trains_exactly_the_adapters_and_says_how_many(targets) -> None:
    task = tiny_task()
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
    task = tiny_task(ClassificationTask, finetune={"lora": {"rank": RANK}})
    head = sum(p.numel() for p in task.model.head.parameters())
    n_base = parameter_counts(task.model)[1]
    task.apply_finetune()
    expected = _expected_trainable(n_attentions=1, n_layers=1, targets=("q", "k", "v", "o")) + head
    assert parameter_counts(task.model) == (expected, n_base + expected - head)
    # a classifier's projections are all in its encoder: LoRA would adapt nothing, so it is refused
    with pytest.raises(ValueError, match=r"are all in what finetune\.freeze=encoder freezes") as refused:
        tiny_task(ClassificationTask, finetune={"freeze": "encoder", "lora": {"rank": RANK}})
    assert "\n" not in str(refused.value)
    frozen = tiny_task(ClassificationTask, finetune={"freeze": "encoder"})  # the head alone, as it says
    frozen.apply_finetune()
    assert parameter_counts(frozen.model)[0] == head


def test_a_rank_larger_than_a_projection_is_refused_naming_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"finetune\.lora\.rank=65 is larger than the ff projection .* at most 32"
    ):
        tiny_task(finetune={"lora": {"rank": 65, "targets": ["ff"]}})
    with pytest.raises(
        ValueError, match=r"finetune\.lora\.rank=40 is larger than the ff projection .* at most 32"
    ):
        tiny_task(finetune={"lora": {"rank": 40, "targets": ["ff"]}})  # linear1 (64 x 32): its 32 columns
    with pytest.raises(ValueError, match=r"finetune\.lora\.rank=33 is larger than the q projection"):
        tiny_task(finetune={"lora": {"rank": 33, "targets": ["q"]}})
    for bad, key in (
        ({"freeze": "decoder"}, "finetune.freeze"),
        ({"lora": {"rank": 2, "targets": ["x"]}}, "lora.targets"),
    ):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            FinetuneSettings.from_values(bad)


def test_lora_training_changes_only_the_adapters_and_its_checkpoint_evaluates_merged(tmp_path) -> None:
    task = tiny_task(finetune={"lora": {"rank": RANK, "targets": ["q", "k", "v", "o", "ff"]}})
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
    batch = copy_batch()
    torch.testing.assert_close(
        logits_of(restored.model, batch), logits_of(task.model, batch), atol=1e-6, rtol=0
    )
    resumed = tiny_task(finetune=dict(task.hparams.finetune))  # resume: the same layout, then the state
    resumed.apply_finetune()
    resumed.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    assert torch.equal(logits_of(resumed.model, batch), logits_of(task.model, batch))


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
    randomize_adapters(model)
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
    randomize_adapters(model)
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
        task = tiny_task(finetune={"lora": {"rank": D, "targets": targets}})
        task.apply_finetune()
        assert any(".lora_A." in name for name, _ in task.model.named_parameters())
        with pytest.raises(ValueError, match=rf"finetune\.lora\.rank={D + 1} is larger than"):
            tiny_task(finetune={"lora": {"rank": D + 1, "targets": targets}})


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

"""`model.fused_loss` (`TranslationTask._projected_loss`): a training step with the output projection and the
label-smoothed loss fused (`losses.linear_label_smoothed_cross_entropy`) has the plain step's loss, logged
metrics and gradients within 1e-6 relative in float32, on the packed path (non-pad rows only) and the
padded one (all rows, no host read), with and without smoothing, tied and untied embeddings and an output
bias; validation keeps the plain path; bad values and `model.compile` are refused in one line naming the
keys; hyperparameters saved before the key existed load with it off.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torch import Tensor
from torch.overrides import TorchFunctionMode

from tests.helpers.repo import REPO_ROOT
from tests.helpers.tasks import logged_training_step
from transformer import losses
from transformer.cli import build, checks, errors
from transformer.cli.errors import ConfigError
from transformer.losses import TokenLoss
from transformer.training import TranslationTask, translation

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PAD = 19, 0
CONFIG = {
    "src_vocab_size": VOCAB,
    "tgt_vocab_size": VOCAB,
    "d_model": 16,
    "n_heads": 2,
    "n_encoder_layers": 1,
    "n_decoder_layers": 2,
    "d_ff": 32,
    "dropout": 0.0,
    "max_len": 32,
}
# padded (the GPU's layout) or packed (the CPU's default: only non-pad tokens reach the projection)
PATHS = ("packed", "padded")


def _batch(seed: int = 0, lengths: tuple[int, ...] = (3, 9, 6, 1, 9)) -> dict[str, Tensor]:
    """Pairs of random lengths (sources 2 longer), right-padded: BOS=1 ... EOS=2, tokens 3 .. VOCAB-1."""
    generator = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths) + 1
    src = torch.full((B, T + 2), PAD)
    tgt = torch.full((B, T + 1), PAD)
    for row, n in enumerate(lengths):
        src[row, : n + 3] = torch.cat(
            [torch.randint(3, VOCAB, (n + 2,), generator=generator), torch.tensor([2])]
        )
        tgt[row, : n + 2] = torch.cat(
            [torch.tensor([1]), torch.randint(3, VOCAB, (n,), generator=generator), torch.tensor([2])]
        )
    return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:], "id": torch.arange(B)}


def _task(path: str, fused: bool, *, label_smoothing: float = 0.1, **config: Any) -> TranslationTask:
    """A training-mode task drawn with seed 0 (the same weights for fused and plain); an output bias gets
    random values, so a projection without it would give other logits."""
    torch.manual_seed(0)
    task = TranslationTask({**CONFIG, **config}, label_smoothing=label_smoothing, fused_loss=fused).train()
    if task.model.output_projection.bias is not None:
        with torch.no_grad():
            task.model.output_projection.bias.normal_(0.0, 0.5)
    task.model.pack_tokens = path == "packed"
    return task


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Records the (hidden, target) shapes of each fused loss the task computes."""
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    fused = translation.linear_label_smoothed_cross_entropy

    def recording(
        hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, **kw: Any
    ) -> TokenLoss:
        calls.append((tuple(hidden.shape), tuple(target.shape)))
        return fused(hidden, weight, bias, target, **kw)

    monkeypatch.setattr(translation, "linear_label_smoothed_cross_entropy", recording)
    return calls


@pytest.mark.parametrize("output_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("tie", ["all", "none"], ids=["tied", "untied"])
@pytest.mark.parametrize("label_smoothing", [0.1, 0.0], ids=["eps0.1", "eps0"])
@pytest.mark.parametrize("path", PATHS)
def test_a_fused_training_step_equals_the_plain_one(
    monkeypatch: pytest.MonkeyPatch, path: str, label_smoothing: float, tie: str, output_bias: bool
) -> None:
    batch = _batch()
    settings = {"label_smoothing": label_smoothing, "tie_embeddings": tie, "output_bias": output_bias}
    plain_logged, plain_grads = logged_training_step(_task(path, False, **settings), batch)
    calls = _fused_calls(monkeypatch)
    task = _task(path, True, **settings)
    logged, grads = logged_training_step(task, batch)

    keep = batch["tgt_out"].ne(PAD)
    if path == "packed":  # the non-pad rows only
        assert calls == [((int(keep.sum()), CONFIG["d_model"]), (int(keep.sum()),))]
    else:  # every position, pads weighted 0: the batch's own shape, nothing sized by the data
        assert calls == [((*keep.shape, CONFIG["d_model"]), tuple(keep.shape))]
    for name in ("train/loss", "train/ppl", "train/token_acc", "returned loss"):
        torch.testing.assert_close(logged[name], plain_logged[name], rtol=1e-6, atol=0, msg=name)
    assert logged.keys() == plain_logged.keys()
    assert grads.keys() == plain_grads.keys()
    projection = task.model.output_projection
    # tied: one (V, D) matrix, whose gradient sums the projection's (the fused loss's) and the embeddings'
    assert (projection.weight is task.model.tgt_embed.embedding.weight) == (tie == "all")
    assert (projection.bias is not None) == output_bias
    for name, want in plain_grads.items():
        assert want is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], want, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("path", PATHS)
def test_a_chunked_fused_step_equals_the_plain_one(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Chunks of 3 rows: the weight's gradient summed over chunks, into the tied matrix and the bias."""
    batch = _batch(seed=1)
    settings = {"tie_embeddings": "all", "output_bias": True}
    plain_logged, plain_grads = logged_training_step(_task(path, False, **settings), batch)
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 3 * VOCAB)
    logged, grads = logged_training_step(_task(path, True, **settings), batch)
    torch.testing.assert_close(logged["train/loss"], plain_logged["train/loss"], rtol=1e-6, atol=0)
    for name, want in plain_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("path", PATHS)
def test_validation_and_steps_without_gradients_keep_the_plain_loss(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    batch = _batch()
    reference = _task(path, False).eval()._token_loss(batch)
    calls = _fused_calls(monkeypatch)
    task = _task(path, True)
    with torch.no_grad():
        in_training = task._token_loss(batch)  # training mode, no gradient (e.g. a look at the loss)
    task.eval()  # as validation_step and test_step run (Lightning adds no_grad / inference_mode)
    evaluated = task._token_loss(batch)
    assert calls == []
    for out in (in_training, evaluated):
        torch.testing.assert_close(out.loss, reference.loss, rtol=0, atol=0)
        assert out.n_correct == reference.n_correct and out.n_tokens == reference.n_tokens


class _HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host or size a result by it (a GPU would wait)."""

    NAMES = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        masks = [a for a in (args[1:2] if name in ("__getitem__", "__setitem__") else ()) if _is_mask(a)]
        if name in self.NAMES or name in ("masked_select", "argwhere", "unique") or masks:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _is_mask(index: object) -> bool:
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices)


def test_the_padded_fused_step_reads_nothing_back() -> None:
    """The GPU's layout: forward, fused loss and backward without one host read."""
    batch = _batch()
    task = _task("padded", True)
    with _HostReads() as counter:
        out = task._token_loss(batch)
        out.loss.backward()
    assert counter.reads == []
    packed = _HostReads()
    with packed:  # the counter sees reads: the packed path (the CPU's) gathers its rows by the data
        _task("packed", True)._token_loss(batch)
    assert packed.reads


# --- refusals and old checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, 0, None])
def test_a_fused_loss_that_is_not_a_bool_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^fused_loss must be true or false, got {value!r}$"):
        TranslationTask(CONFIG, fused_loss=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("compile", [True, "layers"])
def test_the_fused_loss_is_refused_with_a_compiled_step(compile: bool | str) -> None:
    with pytest.raises(
        ValueError, match=rf"model\.fused_loss=true does not go with model\.compile={str(compile).lower()}"
    ):
        TranslationTask(CONFIG, fused_loss=True, compile=compile)
    TranslationTask(CONFIG, fused_loss=False, compile=compile)  # each alone is fine


def _model_node(**values: Any) -> Any:
    return OmegaConf.create({"_target_": "transformer.training.TranslationTask", "config": CONFIG, **values})


def _error_line(err: Exception) -> str:
    """The line train.py prints for `err` (its exit message)."""
    return str(errors.user_error(err))


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ({"fused_loss": "yes"}, "error: `model.fused_loss` must be true or false, got 'yes'"),
        ({"fused_loss": 1}, "error: `model.fused_loss` must be true or false, got 1"),
        (
            {"fused_loss": True, "compile": True},
            "error: model.fused_loss=true does not go with model.compile=true: the compiled step fuses the "
            "output projection and the loss itself (set model.fused_loss=false or model.compile=false)",
        ),
        (
            {"fused_loss": True, "compile": "layers"},
            "error: model.fused_loss=true does not go with model.compile=layers: the fused loss is tested on "
            "the eager step only, not around compiled layers (set model.fused_loss=false or "
            "model.compile=false)",
        ),
    ],
    ids=["string", "integer", "compile-true", "compile-layers"],
)
def test_bad_settings_are_one_error_line_before_any_data_is_read(values: dict[str, Any], line: str) -> None:
    """`checks.check_compile` (run by train.py's check_config before the data is prepared) gives the line;
    building the task from the config (`build.instantiate`, after the data) names the keys too."""
    cfg = OmegaConf.create({"model": values, "trainer": {"accelerator": "cpu"}})
    with pytest.raises(ConfigError) as raised:
        checks.check_compile(cfg)
    assert _error_line(raised.value) == line
    with pytest.raises(ConfigError) as built:
        build.instantiate(_model_node(**values), "model")
    assert _error_line(built.value).startswith("error: ")
    assert "\n" not in _error_line(built.value)
    assert all(
        key in _error_line(built.value)
        for key in ("fused_loss", *(["compile"] if "compile" in values else []))
    )


def test_the_config_has_it_off_and_the_check_lets_it_pass() -> None:
    node = yaml.safe_load((REPO_ROOT / "configs" / "model" / "translation.yaml").read_text())
    assert node["fused_loss"] is False and node["compile"] is False
    for fused in (False, True):
        checks.check_compile(
            OmegaConf.create({"model": {"fused_loss": fused}, "trainer": {"accelerator": "cpu"}})
        )
    task = build.instantiate(_model_node(fused_loss=True), "model")
    assert task.hparams.fused_loss is True


def test_hyperparameters_saved_without_the_key_load_with_it_off(tmp_path, monkeypatch) -> None:
    """A checkpoint written before `fused_loss` existed (its hyperparameters lack the key)."""
    task = TranslationTask(CONFIG, label_smoothing=0.1)
    hparams = dict(task.hparams)
    del hparams["fused_loss"]
    path = tmp_path / "old.ckpt"
    torch.save(
        {
            "state_dict": task.state_dict(),
            "hyper_parameters": hparams,
            "pytorch-lightning_version": L.__version__,
        },
        path,
    )
    restored = TranslationTask.load_from_checkpoint(path, map_location="cpu")
    assert restored.hparams.fused_loss is False
    calls = _fused_calls(monkeypatch)
    restored.train()._token_loss(_batch()).loss.backward()
    assert calls == []

"""Translation: label-smoothed cross entropy, perplexity and decoded sacreBLEU on validation and test."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.config import TransformerConfig
from transformer.evaluation.init_from import imported_note, init_origin, load_pretrained_translation
from transformer.evaluation.restore import LANGUAGE_LABELS_KEY
from transformer.evaluation.scoring import corpus_scores, direction_scores
from transformer.losses import TokenLoss, label_smoothed_cross_entropy, linear_label_smoothed_cross_entropy
from transformer.model import Seq2SeqTransformer
from transformer.packing import BatchPacking
from transformer.search.decoding import DecodingSettings, decode
from transformer.stacks import compile_layers
from transformer.training.base import (
    OptimizerFactory,
    SchedulerFactory,
    TaskBase,
    TokenMeans,
    plain,
)
from transformer.training.compiling import CompiledStep, check_compile_mode, fused_loss_conflict, pad_length

log = logging.getLogger(__name__)


class TranslationTask(TaskBase):
    """Sequence-to-sequence training (section 5) with validation BLEU from greedy or beam search.

    With `compile=True` the training forward and loss run as one `torch.compile`d graph over the padded
    batch (`_padded_token_loss`, `transformer.training.compiling`); with `compile="layers"` the same padded
    step runs eagerly around compiled encoder and decoder layers (`compile_layers`). Validation and test
    stay eager. With `fused_loss=True` an eager training step forms the output projection and the loss in
    one pass (`_projected_loss`).
    """

    best_metric = ("bleu", "max")

    def __init__(
        self,
        config: Mapping[str, Any],
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        label_smoothing: float = 0.1,
        decoding: Mapping[str, Any] | None = None,
        test_decoding: Mapping[str, Any] | None = None,
        val_bleu_every_n_epochs: int = 1,
        init_from: str | None = None,
        finetune: Mapping[str, Any] | None = None,
        compile: bool | str = False,
        activation_checkpointing: bool = False,
        low_precision_residual: bool | str = "auto",
        fused_loss: bool = False,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, run_config)
        check_compile_mode(compile)
        if not isinstance(fused_loss, bool):
            raise ValueError(f"fused_loss must be true or false, got {fused_loss!r}")
        if fused_loss and (conflict := fused_loss_conflict(compile)):
            raise ValueError(conflict)
        config = plain(config)
        # plain dicts in the hyperparameters (checkpoints hold plain data); test defaults to validation's
        decoding = dict(DecodingSettings.from_values(plain(decoding), prefix="decoding."))
        test_decoding = dict(DecodingSettings.from_values(plain(test_decoding), decoding, "test_decoding."))
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        if isinstance(val_bleu_every_n_epochs, bool) or not (
            isinstance(val_bleu_every_n_epochs, int) and val_bleu_every_n_epochs >= 1
        ):
            raise ValueError(
                f"val_bleu_every_n_epochs must be an integer >= 1, got {val_bleu_every_n_epochs!r}"
            )
        self.save_hyperparameters(logger=False, ignore=["optimizer", "scheduler", "run_config"])
        self.model = Seq2SeqTransformer(TransformerConfig.from_dict(config))
        self._take_finetune(finetune)
        self.pad_id = self.model.config.pad_id
        self.val_means, self.test_means = TokenMeans(), TokenMeans()
        self._decoded: list[tuple[Tensor, Tensor]] = []  # this epoch's (ids (B,), tokens (B, L)), on device

    def load_init_from(self, tokenizers: Mapping[str, str] | None = None) -> int:
        """Copy every weight of the translation checkpoint `init_from` (trained here or imported with
        aiayn-import) into the model, whose config is the checkpoint's (train.py sees to that).
        `tokenizers` (the datamodule's `state_dict()` entry) must be the checkpoint's. `train.py` calls this
        before a fresh fit, not on resume. Returns the number of tensors copied (0 without `init_from`)."""
        if not self.hparams.init_from:
            return 0
        loaded = load_pretrained_translation(self.model, self.hparams.init_from, tokenizers)
        self.started_from = init_origin(self.hparams.init_from)
        log.info(
            "Initialized all %d tensors from %s%s",
            loaded,
            self.hparams.init_from,
            imported_note(self.started_from),
        )
        return loaded

    # --- loss -------------------------------------------------------------------------------------

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V)."""
        return self.model(src, tgt_in)

    def _compile(self) -> None:
        layers = self.hparams.compile == "layers"
        if layers:  # on padded batches, as the whole step: the packed path's shapes depend on the data
            compile_layers(self.model, self.compile_backend, self.compile_fullgraph)
            self.model.pack_tokens = False
        self._compiled_step = CompiledStep(
            self._padded_token_loss,
            "the training step's layers" if layers else "the training step (forward and label-smoothed loss)",
            backend=self.compile_backend,
            fullgraph=self.compile_fullgraph,
            whole=not layers,
        )

    def _padded_token_loss(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> TokenLoss:
        """The loss over the padded (B, T) layout (pads ignored by the loss): fixed shapes, what compiles."""
        hidden = self.model(src, tgt_in, return_hidden=True)  # (B, T, D)
        return self._projected_loss(hidden, tgt_out)

    def _projected_loss(self, hidden: Tensor, target: Tensor) -> TokenLoss:
        """The output projection of hidden (..., D) and the label-smoothed loss against target (...).

        In a training step with `fused_loss` (never compiled: `__init__` refuses it with `compile`) both
        run as one, chunk by chunk with the gradients formed in the forward pass, so the (..., V) logits
        and their gradient are never whole (`linear_label_smoothed_cross_entropy`); the weight's gradient
        reaches the output projection's parameter, shared with the embeddings when they are tied.
        Validation and test (no gradient) project, then take the loss.
        """
        projection = self.model.output_projection
        smoothing = self.hparams.label_smoothing
        if self.hparams.fused_loss and self.training and torch.is_grad_enabled():
            return linear_label_smoothed_cross_entropy(
                hidden,
                projection.weight,
                projection.bias,
                target,
                ignore_index=self.pad_id,
                label_smoothing=smoothing,
            )
        logits = projection(hidden)  # (..., V)
        return label_smoothed_cross_entropy(
            logits, target, ignore_index=self.pad_id, label_smoothing=smoothing
        )

    def _token_loss(self, batch: Mapping[str, Tensor]) -> TokenLoss:
        """The batch's loss terms. Packed (the CPU's eager path, or any device with `data.packing`, whose
        packing the collator built on the host): only the non-pad positions reach the output projection
        and the softmax. Otherwise (GPU, compiled) the padded layout, whose shapes do not depend on the
        data: nothing is read back to the host."""
        if self._compiled_step is not None and self.training and torch.is_grad_enabled():
            src, tgt_in, tgt_out = (pad_length(batch[k], self.pad_id) for k in ("src", "tgt_in", "tgt_out"))
            return self._compiled_step(src, tgt_in, tgt_out)
        if "packing" in batch:  # data.packing: built on the host, so any device packs with no host read
            packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
            hidden = self.model(batch["src"], batch["tgt_in"], return_hidden=True, packing=packing)  # (N, D)
            return self._projected_loss(hidden, packing.target.pack(batch["tgt_out"]))
        if not self.model.packing_on(batch["src"].device):
            return self._padded_token_loss(batch["src"], batch["tgt_in"], batch["tgt_out"])
        tgt_out = batch["tgt_out"]
        keep = tgt_out.ne(self.pad_id)  # (B, T)
        # only the non-pad positions: the layers, the (D x V) projection and the softmax skip the padding
        hidden = self.model(batch["src"], batch["tgt_in"], return_hidden=True, positions=keep)  # (N, D)
        return self._projected_loss(hidden, tgt_out[keep])

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        out = self._token_loss(batch)
        B = batch["src"].size(0)
        self._log_training_loss(out.loss, B)
        self.log("train/ppl", out.nll.detach().exp(), batch_size=B)
        self.log("train/token_acc", out.n_correct / out.n_tokens.clamp(min=1), batch_size=B)
        n_real = batch["src"].ne(self.pad_id).sum() + out.n_tokens  # on the device: no host read per step
        self._log_throughput(n_real, batch["src"].numel() + batch["tgt_out"].numel(), B)
        return out.loss

    # --- validation and test: token metrics, then decoding and BLEU -------------------------------

    def _decodes_this_epoch(self) -> bool:
        if self.trainer.sanity_checking:
            return True  # one batch through the decoding path before training starts
        return (self.current_epoch + 1) % self.hparams.val_bleu_every_n_epochs == 0

    def on_validation_epoch_start(self) -> None:
        self._decoded = []

    def on_test_epoch_start(self) -> None:
        self._decoded = []

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        if not self._repeated_share():  # its hypotheses count once anyway: scored by example id
            self.val_means.update(self._token_loss(batch))
        if self._decodes_this_epoch():
            self._decode(batch)

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        if not self._repeated_share():
            self.test_means.update(self._token_loss(batch))
        self._decode(batch)

    def translate(self, src: Tensor, decoding: Mapping[str, Any] | None = None) -> Tensor:
        """src (B, S) -> best hypotheses (B, L) after BOS (`decoding` over the validation settings)."""
        return decode(self.model, src, DecodingSettings.from_values(decoding, self.hparams.decoding))

    def _decode(self, batch: Mapping[str, Tensor]) -> None:
        settings = self.hparams.test_decoding if self.trainer.testing else self.hparams.decoding
        # kept on the device: read back and detokenized once, at the end of the epoch
        self._decoded.append((batch["id"], self.translate(batch["src"], settings)))  # (B,), (B, L)

    def on_validation_epoch_end(self) -> None:
        self._log_means("val", self.val_means)
        if not self._decodes_this_epoch():
            return
        scores = self._score("val")
        for name, value in scores.items():
            self.log(f"val/{name}", value, prog_bar=name == "bleu", sync_dist=True)
        self._log_best(scores["bleu"])

    def on_test_epoch_end(self) -> None:
        self._log_means("test", self.test_means)
        for name, value in self._score("test").items():
            self.log(f"test/{name}", value, sync_dist=True)

    def _log_means(self, stage: str, means: TokenMeans) -> None:
        for name, value in means.compute_and_reset().items():
            self.log(f"{stage}/{name}", value, prog_bar=name == "loss", sync_dist=True)

    def _score(self, stage: Literal["val", "test"]) -> dict[str, float]:
        """`corpus_scores` (sacreBLEU cased and lowercased, chrF, exact match) of this epoch's hypotheses,
        and `n_sentences`, how many sentences they were computed on.

        Under DDP each process decodes its share of the split (the evaluation samplers deal the batches
        to the ranks); the token ids of all shares are gathered on the device, and every process
        detokenizes and scores the whole split in example-id order: the same corpus scores everywhere
        (corpus BLEU is not a mean of per-process BLEUs), equal to one process's.
        """
        ids, tokens = gather_decoded(self._decoded, self.pad_id, self.device)
        if self.trainer.world_size > 1:
            log.info("%s: this process decoded %d of the %d sentences", stage, self._n_local(), ids.numel())
        self._decoded = []
        texts = self._datamodule().tgt_tokenizer.decode_batch(tokens.tolist())
        return self._score_hypotheses(stage, dict(zip(ids.tolist(), texts)))

    def _score_hypotheses(
        self, stage: Literal["val", "test"], hypotheses: Mapping[int, str]
    ) -> dict[str, float]:
        """The scores of `hypotheses` (example id -> text; a sentence decoded twice, on two ranks of a tiny
        split, counts once) against the references of `stage`'s split."""
        split = self._split_name(stage)
        references = self._datamodule().references(split)
        order = sorted(hypotheses)
        hyps, refs = [hypotheses[i] for i in order], [references[i] for i in order]
        # several directions (a multilingual datamodule's `directions`): scored each, the means selecting
        directions_of = getattr(self._datamodule(), "directions", None)
        directions = directions_of(split) if callable(directions_of) else None
        if directions is None:
            scores = corpus_scores(hyps, refs)
        else:
            scores = direction_scores(hyps, refs, [directions[i] for i in order])
        return {**scores, "n_sentences": float(len(order))}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also the target-language labels of a multilingual model under the checkpoint's own key, where
        programs read them (`data.labels.LABELS_KEY`; the datamodule state holds them as well)."""
        super().on_save_checkpoint(checkpoint)
        labels = (checkpoint.get("TranslationDataModule") or {}).get(LANGUAGE_LABELS_KEY)
        if labels:
            checkpoint[LANGUAGE_LABELS_KEY] = labels

    def _n_local(self) -> int:
        return sum(len(ids) for ids, _ in self._decoded)

    def _datamodule(self) -> Any:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            raise ValueError(
                "TranslationTask decodes against a datamodule's tokenizer and references: "
                "pass `datamodule=` to the Trainer's fit/validate/test"
            )
        return datamodule

    def _split_name(self, stage: str) -> str:
        """The datamodule's name of the split that `stage` scores (e.g. test -> test_2016_flickr)."""
        splits = getattr(self._datamodule(), "splits", None)
        return splits[stage] if isinstance(splits, Mapping) and stage in splits else stage


def gather_decoded(
    parts: list[tuple[Tensor, Tensor]], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Every process's decoded batches [(ids (B,), tokens (B, L)), ...] -> ids (N,), tokens (N, W) of all
    processes (one process: its own), pad-filled to the longest. The collectives run on `device` (gloo on
    the CPU, NCCL on CUDA): the shares' sizes, then the ids and tokens padded to the largest share."""
    width = max((tokens.size(1) for _, tokens in parts), default=1)
    ids = torch.cat([i for i, _ in parts]) if parts else torch.zeros(0, dtype=torch.long, device=device)
    tokens = torch.full((0, width), pad_id, dtype=torch.long, device=device)
    if parts:
        tokens = torch.cat([F.pad(t, (0, width - t.size(1)), value=pad_id) for _, t in parts])
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ids, tokens
    world = torch.distributed.get_world_size()
    sizes = [torch.empty(2, dtype=torch.long, device=device) for _ in range(world)]
    torch.distributed.all_gather(sizes, torch.tensor([ids.numel(), width], device=device))
    counts, widths = torch.stack(sizes).T.tolist()  # one host read, before the data
    ids = F.pad(ids, (0, max(counts) - ids.numel()), value=-1)
    tokens = F.pad(tokens, (0, max(widths) - width, 0, max(counts) - tokens.size(0)), value=pad_id)
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    all_tokens = [torch.empty_like(tokens) for _ in range(world)]
    torch.distributed.all_gather(all_ids, ids)
    torch.distributed.all_gather(all_tokens, tokens)
    return (
        torch.cat([part[:n] for part, n in zip(all_ids, counts)]),
        torch.cat([part[:n] for part, n in zip(all_tokens, counts)]),
    )

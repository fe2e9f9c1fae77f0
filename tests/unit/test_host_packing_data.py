"""`data.packing` (#50 item 3): the translation datamodule's batches carry the packing built on the host,
equal to what the model finds on the device; off by default; a non-boolean value is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.datamodules import TranslationDataModule
from transformer.packing import BatchPacking, TokenPacking, prefix_mask


def _synthetic(tmp_path: Path, **kwargs: object) -> TranslationDataModule:
    dm = TranslationDataModule(
        synthetic_sizes={"train": 200, "val": 20, "test": 20},
        vocab_size=120,
        max_tokens=300,
        max_len=40,
        show_progress=False,
        cache_dir=tmp_path,
        **kwargs,
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_batches_carry_the_host_packing_when_asked(tmp_path: Path) -> None:
    dm = _synthetic(tmp_path, packing=True)
    batches = [*dm.train_dataloader(), *dm.val_dataloader()]
    assert all("packing" in batch for batch in batches)
    for batch in batches:
        packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
        for host, device in (
            (packing.source, TokenPacking(~batch["src_padding_mask"])),
            (packing.target, TokenPacking(prefix_mask(batch["tgt_in"], dm.pad_id))),
        ):
            assert torch.equal(host.keep, device.keep) and torch.equal(host.index, device.index)
            lengths = device.keep.sum(dim=1)
            assert torch.equal(host.cu_seqlens[1:], lengths.cumsum(0).int()) and host.max_len == lengths.max()


def test_packing_is_off_by_default_and_boolean(tmp_path: Path) -> None:
    dm = _synthetic(tmp_path)
    assert not any("packing" in batch for batch in dm.val_dataloader())
    with pytest.raises(ValueError, match="packing must be true or false, got 'yes'"):
        TranslationDataModule(synthetic_sizes={"train": 10, "val": 5, "test": 5}, packing="yes")  # type: ignore[arg-type]

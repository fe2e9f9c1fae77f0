"""Word alignments as a user sees them: the subword attention of `transformer.search.alignments` summed
into whitespace words of the source line and of the output line, written in the Pharaoh format
(`0-0 1-2 ...`: source word - output word, 0-based); a scored split's file of them (`write_alignments`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from data.tokenization import WORD_START
from transformer.disk import write_text
from transformer.search.alignments import cross_attention, word_alignment
from transformer.search.decoding import DecodingSettings
from transformer.search.step import Searchable

__all__ = ["Aligner", "pharaoh", "piece_function", "split_alignment_lines", "word_index", "write_alignments"]


def word_index(pieces: Sequence[str | None]) -> list[int]:
    """Subword pieces (None: a special token) -> the word of each (-1: none): a piece that starts with
    WORD_START ("▁") starts a new word, the others continue it (as the tokenizer's decoder joins them)."""
    index, word = [], -1
    for piece in pieces:
        if piece is None:
            index.append(-1)
            continue
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        index.append(word)
    return index


def pharaoh(pairs: Sequence[tuple[int, int]], n_src: int, n_tgt: int) -> str:
    """Pairs -> "i-j ..." with the indices kept inside the lines' word counts (a piece that decodes to
    no visible word cannot point past the line)."""
    if not n_src or not n_tgt:
        return ""
    return " ".join(f"{min(i, n_src - 1)}-{min(j, n_tgt - 1)}" for i, j in pairs)


class Aligner:
    """Alignment lines for a search's output: `model`'s decoder layer `layer` (negative: from the top),
    the pieces of source and target token ids (`src_piece` / `tgt_piece`: None for special tokens)."""

    def __init__(
        self,
        model: Searchable,
        layer: int,
        src_piece: Callable[[int], str | None],
        tgt_piece: Callable[[int], str | None],
    ) -> None:
        self.model, self.layer, self.src_piece, self.tgt_piece = model, layer, src_piece, tgt_piece

    def lines(
        self, src: Tensor, tokens: Tensor, sources: Sequence[str], outputs: Sequence[Sequence[str]]
    ) -> list[list[str]]:
        """src (B, S) and the search's tokens (B, N, L) -> per sentence, for each of its output texts
        (`outputs[b]`, at most N, best first) the Pharaoh line against `sources[b]`."""
        batch, n, length = tokens.shape
        attention = cross_attention(
            self.model, src.repeat_interleave(n, dim=0), tokens.reshape(batch * n, length), self.layer
        ).cpu()  # (B * N, L, S): read back once per batch, after the search
        src_rows, token_rows = src.tolist(), tokens.reshape(batch * n, length).tolist()
        result = []
        for b in range(batch):
            src_words = word_index([self.src_piece(i) for i in src_rows[b]])
            lines = []
            for k, text in enumerate(outputs[b]):
                tgt_words = word_index([self.tgt_piece(i) for i in token_rows[b * n + k]])
                pairs = word_alignment(attention[b * n + k], src_words, tgt_words)
                lines.append(pharaoh(pairs, len(sources[b].split()), len(text.split())))
            result.append(lines)
        return result


def piece_function(tokenizer: object, specials: set[int]) -> Callable[[int], str | None]:
    """A tokenizer's id -> its piece (None: a special token); a tokenizer without pieces: each token
    its own word."""
    backend = getattr(tokenizer, "tokenizer", None)  # BPETokenizer wraps a `tokenizers.Tokenizer`

    def piece(i: int) -> str | None:
        if i in specials:
            return None
        return (backend.id_to_token(i) or WORD_START) if backend is not None else WORD_START + str(i)

    return piece


def split_alignment_lines(
    aligner: Aligner,
    encode_source: Callable[[str], list[int]],
    sources: Sequence[str],
    hypothesis_ids: Sequence[Sequence[Sequence[int]]],
    hypotheses: Sequence[Sequence[str]],
    pad_id: int,
    device: torch.device,
    batch_size: int = 64,
) -> list[list[str]]:
    """A scored split's alignment lines, in split order: per sentence one line for each of its hypotheses
    (`hypothesis_ids[i]`: their token ids, EOS-terminated, best first; `hypotheses[i]`: their texts), the
    sources encoded as the split was, `batch_size` sentences a pass."""
    lines: list[list[str]] = []
    for start in range(0, len(sources), batch_size):
        chunk = range(start, min(start + batch_size, len(sources)))
        src = _padded([encode_source(sources[i]) for i in chunk], pad_id, device)  # (b, S)
        most = max(len(hypothesis_ids[i]) for i in chunk)  # fewer for a sentence: all-pad rows, unread
        rows = [list(hypothesis_ids[i]) + [[]] * (most - len(hypothesis_ids[i])) for i in chunk]
        tokens = _padded([row for sentence in rows for row in sentence], pad_id, device)  # (b * n, L)
        tokens = tokens.view(len(chunk), most, -1)
        lines += aligner.lines(src, tokens, [sources[i] for i in chunk], [hypotheses[i] for i in chunk])
    return lines


def _padded(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> Tensor:
    width = max(1, max(len(row) for row in rows))
    return torch.tensor([list(row) + [pad_id] * (width - len(row)) for row in rows], device=device)


def write_alignments(
    path: Path, model: Any, datamodule: Any, result: Any, decoding: DecodingSettings
) -> Path:
    """decode.alignments=true: the hypotheses' word alignments (Pharaoh), one line per sentence; with
    decode.n_best > 1 one `id ||| pairs` line per hypothesis, as nbest.txt and translate.input do."""
    config = model.config
    specials = {config.pad_id, config.bos_id, config.eos_id}
    aligner = Aligner(
        model,
        decoding.alignment_layer,
        piece_function(datamodule.src_tokenizer, specials),
        piece_function(datamodule.tgt_tokenizer, specials),
    )
    device = next(model.parameters()).device
    tokenizer = datamodule.src_tokenizer
    n_best = bool(result.n_best)
    ids = result.n_best_ids if n_best else [[ids] for ids in result.hypothesis_ids]
    texts = (
        [[text for text, _ in hyps] for hyps in result.n_best] if n_best else [[h] for h in result.hypotheses]
    )
    lines = split_alignment_lines(
        aligner,
        lambda text: tokenizer.encode(text)[: datamodule.max_len],
        result.sources,
        ids,
        texts,
        config.pad_id,
        device,
    )
    text = "".join(
        f"{i} ||| {line}\n" if n_best else f"{line}\n"
        for i, sentence in enumerate(lines)
        for line in sentence
    )
    return write_text(path, text, "the word alignments")

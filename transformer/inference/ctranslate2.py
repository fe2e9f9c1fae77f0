"""`CTranslate2Translator`: the inference API's `Translator` with CTranslate2 doing the search (issue 64,
item 5; docs/serving.md "The CTranslate2 backend").

The checkpoint is converted once by the existing export (`transformer.interop.ctranslate2`, checked against
the checkpoint when written) into a directory named by the checkpoint file's digest: a `cache_dir` reused
by later loads, or a temporary one removed with the translator. Texts go through the checkpoint's own
tokenizers and the same token-budget batches as `Translator`'s (`transformer.inference.loading`,
`batches`), so the same token ids reach both backends. What CTranslate2 cannot do as our search does is
refused with one `InferenceError` naming the option (`ctranslate2_options.ctranslate2_refusal`); what it
does is mapped:

- the per-sentence length limit floor(max_len_a * source length + max_len_b) (EOS included, forced at the
  limit) as `max_decoding_length` = limit - 1 (CTranslate2 counts an EOS it generates and stops without
  one there; ours then adds the forced EOS): in beam search sentences of one limit go to CTranslate2
  together; greedy search and sampling decode a batch at its longest limit and cut each sentence at its
  own. A beam search whose hypotheses reach the limit ranks them without the forced EOS's log-probability
  (CTranslate2's), so such a sentence can get another translation than ours;
- greedy search (`beam_size=1`), beam search with `length_penalty=0` and one hypothesis (CTranslate2's
  beam search ranks by len ** alpha with len without EOS and stops once beam_size hypotheses have ended:
  its best one is ours only at alpha 0), sampling (`sampling_topk` / `sampling_topp`, `num_hypotheses`
  independent samples; CTranslate2's own random numbers), `min_len`, n-gram blocking (greedy and
  sampling), target prefixes;
- scores: every hypothesis is scored by CTranslate2's `score_batch` (teacher-forced log-probabilities, EOS
  included, nothing banned or renormalized) and divided by the settings' length normalization, which is
  our search's score for the same tokens (`<pad>` and `<s>` are suppressed in the search, as ours never
  emits them).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data.batching import TranslationCollator
from transformer.checkpoint import CheckpointError
from transformer.evaluation.n_best import n_best_texts
from transformer.evaluation.restore import checkpoint_decoding
from transformer.inference.batches import token_budget_batches
from transformer.inference.ctranslate2_options import ctranslate2_checked
from transformer.inference.languages import TargetLanguages
from transformer.inference.loading import as_paths, device_of, load, max_tokens_of
from transformer.inference.outputs import Hypothesis, InferenceError, Segment, Translation
from transformer.inference.requests import PhraseEncoder
from transformer.inference.translator import target_langs, unsatisfiable_rows
from transformer.interop.source import ExportError, ExportSource, load_source
from transformer.search.constraints import TargetRequest
from transformer.search.decoding import DecodingSettings
from transformer.search.step import LengthLimits

__all__ = ["CTranslate2Translator"]


class CTranslate2Translator:
    """Translates texts with a checkpoint converted to CTranslate2 and the checkpoint's tokenizers: the
    public surface of `transformer.inference.Translator` (`from_checkpoint`, `translate`, `settings`,
    `defaults`, `languages`, `target_languages`, `target_lang`, `num_parameters`, `paths`, `device`,
    `task`). Call it from one thread at a time."""

    task = "translation"

    def __init__(
        self,
        translator: Any,
        source: ExportSource,
        src_tokenizer: Any,
        tgt_tokenizer: Any,
        defaults: DecodingSettings,
        *,
        max_len: int,
        max_tokens: int,
        device: torch.device,
        compute_type: str,
        directory: Path,
        paths: Sequence[Path] = (),
        languages: tuple[str | None, str | None] = (None, None),
        target_languages: TargetLanguages | None = None,
        target_lang: str | None = None,
    ) -> None:
        self.translator, self.config = translator, source.config
        self.src_tokenizer, self.tgt_tokenizer = src_tokenizer, tgt_tokenizer
        self.defaults, self.max_len, self.max_tokens = defaults, max_len, max_tokens
        self.device, self.compute_type, self.directory = device, compute_type, directory
        self.paths, self.languages = list(paths), languages
        self.target_languages = target_languages or TargetLanguages(target=languages[1])
        self.target_languages.check(target_lang)
        self.target_lang = target_lang
        self.num_parameters = sum(parameter.numel() for parameter in source.model.parameters())
        self._src_tokens, self._tgt_tokens = source.vocabulary("src"), source.vocabulary("tgt")
        self._tgt_ids = {token: i for i, token in enumerate(self._tgt_tokens)}
        config = self.config
        # ours never emits <pad> or the decoder's start token (one token for an imported model)
        self._suppressed = [[self._tgt_tokens[i]] for i in sorted({config.pad_id, config.bos_id})]
        self._phrases = PhraseEncoder.of(tgt_tokenizer)

    @classmethod
    def from_checkpoint(
        cls,
        paths: str | Path | Sequence[str | Path],
        *,
        device: str | torch.device = "cpu",
        compute_type: str = "default",
        max_tokens: int | None = None,
        cache_dir: str | Path | None = None,
        inter_threads: int = 1,
        intra_threads: int | None = None,
        seed: int | None = None,
        target_lang: str | None = None,
    ) -> CTranslate2Translator:
        """One translation checkpoint (trained, averaged into one file, LoRA-merged or imported), converted
        for CTranslate2 and loaded on `device` ("cpu", "cuda", "cuda:N", "auto") with CTranslate2's
        `compute_type` ("default": the converted float32 weights; "int8", "int8_float32", "float16", ...:
        quantized when loaded, as CTranslate2 supports them on that device). `cache_dir`: keep the converted
        directory there, named by the checkpoint's digest, and reuse it; None: a temporary directory removed
        with the translator. `intra_threads`: CTranslate2's threads per batch (default: torch's count).
        `seed`: seeds CTranslate2's random generators, which its threads take when the model loads (so
        sampling's draws repeat for a translator loaded again with the same seed; they are not torch's).
        `target_lang`: the default target language of a multilingual model (one of its labels')."""
        files = as_paths(paths)
        if len(files) != 1:
            raise InferenceError(
                f"the CTranslate2 backend decodes one checkpoint, got {len(files)}: an ensemble needs the "
                "torch backend (or average the checkpoints into one file first)"
            )
        import ctranslate2  # the `export` extra: imported only when this backend is asked for

        from transformer.interop.ctranslate2 import keeping_torch_threads

        target = device_of(device)
        ct2_device = "cuda" if target.type == "cuda" else "cpu"
        if target.type not in ("cpu", "cuda"):
            raise InferenceError(f"device={device}: the CTranslate2 backend runs on cpu or cuda")
        supported = sorted(ctranslate2.get_supported_compute_types(ct2_device))
        if compute_type not in ("default", "auto", *supported):
            raise InferenceError(
                f"compute_type={compute_type!r} is not one CTranslate2 supports on {ct2_device}; expected "
                f"default, auto or one of {supported}"
            )
        loaded = load(files, "translation")
        try:
            defaults = checkpoint_decoding(loaded.first.hparams)
            source = load_source(files[0])
        except (ValueError, CheckpointError) as err:  # ExportError is a ValueError
            raise InferenceError(f"checkpoint {files[0]}: {err}") from None
        directory, keep = _converted(source, files[0], cache_dir)
        if seed is not None:
            ctranslate2.set_random_seed(seed)  # read by the translator's threads as they start
        with keeping_torch_threads():  # CTranslate2 sets the OpenMP thread count torch shares
            translator = ctranslate2.Translator(
                str(directory),
                device=ct2_device,
                device_index=target.index or 0,
                compute_type=compute_type,
                inter_threads=inter_threads,
                intra_threads=torch.get_num_threads() if intra_threads is None else intra_threads,
            )
        made = cls(
            translator,
            source,
            loaded.tokenizers["src"],
            loaded.tokenizers["tgt"],
            defaults,
            max_len=loaded.max_len,
            max_tokens=max_tokens_of(max_tokens, loaded.eval_max_tokens, loaded.max_len),
            device=target,
            compute_type=compute_type,
            directory=directory,
            paths=loaded.paths,
            languages=loaded.languages,
            target_languages=loaded.target_languages,
            target_lang=target_lang,
        )
        if keep is not None:  # a temporary conversion lives as long as the translator
            weakref.finalize(made, shutil.rmtree, keep, ignore_errors=True)
        return made

    def settings(self, **options: Any) -> DecodingSettings:
        """The defaults with `options` over them (`DecodingSettings`' field names), checked for CTranslate2:
        an option it cannot honour exactly is an `InferenceError` naming it."""
        try:
            settings = DecodingSettings.from_values(options, self.defaults)
        except ValueError as err:
            raise InferenceError(str(err)) from None
        return ctranslate2_checked(settings)

    def translate(
        self,
        texts: Sequence[str | Segment],
        settings: DecodingSettings | None = None,
        *,
        generator: torch.Generator | None = None,
        target_lang: str | None = None,
        **options: Any,
    ) -> list[Translation]:
        """One `Translation` per text (a str, or a `Segment` with a prefix), in input order, each into its
        target language (as `Translator.translate`'s `target_lang`, labelled by the same function).
        Sampling draws from CTranslate2's own generators (`from_checkpoint`'s `seed`): a `generator` cannot
        fix them and is refused for sampling (ignored otherwise, as torch's)."""
        if settings is not None and options:
            raise InferenceError("give decoding settings or options, not both")
        if settings is not None and not isinstance(settings, DecodingSettings):
            raise InferenceError(f"settings must be DecodingSettings, got {type(settings).__name__}")
        chosen = self.settings(**options) if settings is None else ctranslate2_checked(settings)
        if chosen.sampling and generator is not None:
            raise InferenceError(
                "generator: CTranslate2 samples with its own random generators, seeded when the model loads "
                "(CTranslate2Translator.from_checkpoint(..., seed=N)); a torch generator cannot fix its draws"
            )
        sources, requests = self._inputs(texts)
        langs, where = target_langs(texts, target_lang)
        langs = [self.target_lang if lang is None else lang for lang in langs]
        outputs: list[Translation | None] = [None] * len(sources)
        ids = self.src_tokenizer.encode_batch(self.target_languages.sources(sources, langs, where))
        collate = TranslationCollator(getattr(self.tgt_tokenizer, "pad_id", self.config.pad_id))
        for batch in token_budget_batches(
            ids, max_len=self.max_len, max_tokens=self.max_tokens, collate=collate
        ):
            indices = batch["id"].tolist()
            mine = [requests[i] for i in indices] if requests is not None else None
            hypotheses = self._decode(batch["src"], chosen, mine)
            flagged = set(unsatisfiable_rows(self.config, batch["src"], chosen, mine)[0]) if mine else set()
            for row, index in enumerate(indices):
                outputs[index] = Translation(hypotheses[row], row in flagged)
        return outputs  # type: ignore[return-value]  # every position filled: each text is in one batch

    def _inputs(self, texts: Sequence[str | Segment]) -> tuple[list[str], list[TargetRequest] | None]:
        """The source texts and (when a segment asks for a prefix) their target requests; required and
        avoided phrases are refused (CTranslate2 has neither)."""
        if isinstance(texts, (str, Segment)) or not isinstance(texts, Sequence):
            raise InferenceError(f"texts must be a list of strings or Segments, got {type(texts).__name__}")
        sources, requests = [], []
        for i, item in enumerate(texts):
            text = item.text if isinstance(item, Segment) else item
            if not isinstance(text, str):
                raise InferenceError(f"segment {i}: the text must be a string, got {text!r}")
            sources.append(text)
            if not isinstance(item, Segment):
                requests.append(TargetRequest())
                continue
            for key in ("constraints", "avoid"):
                if getattr(item, key):
                    raise InferenceError(
                        f"segment {i}: {key}: the CTranslate2 backend cannot require or avoid phrases "
                        "(CTranslate2 has no constrained search); use the torch backend"
                    )
            requests.append(self._phrases.request(f"segment {i}", item))
        return sources, requests if any(requests) else None

    def _decode(
        self, src: torch.Tensor, settings: DecodingSettings, requests: list[TargetRequest] | None
    ) -> list[list[Hypothesis]]:
        """One batch (B, S) of source ids -> each row's hypotheses, best first."""
        config = self.config
        limits = LengthLimits.of(config, src, settings.max_len_a, settings.max_len_b).per_sentence.tolist()
        sources = [self._source_tokens(row) for row in src.tolist()]
        prefixes = [
            [self._tgt_tokens[i] for i in request.prefix] if request.prefix else None
            for request in (requests or [TargetRequest()] * len(sources))
        ]
        n = settings.n_best
        found: list[list[list[int]]] = [[] for _ in sources]  # each row's hypotheses: ids with EOS
        # beam search: one CTranslate2 call per length limit (a beam depends on where hypotheses are cut);
        # greedy search and sampling: one call at the batch's longest limit, each row then cut at its own
        # (a row's tokens before its limit do not depend on the limit: the same tokens, far fewer calls)
        groups = sorted(set(limits)) if not (settings.greedy or settings.sampling) else [max(limits)]
        for group in groups:
            rows = [i for i, limit in enumerate(limits) if limit == group or len(groups) == 1]
            searched = self._search([sources[i] for i in rows], [prefixes[i] for i in rows], settings, group)
            for row, hypotheses in zip(rows, searched):
                limit, eos = limits[row], config.eos_id
                found[row] = [ids if len(ids) <= limit else [*ids[: limit - 1], eos] for ids in hypotheses]
        flat = [(row, hypothesis) for row, hypotheses in enumerate(found) for hypothesis in hypotheses]
        scored = self.translator.score_batch(
            [sources[row] for row, _ in flat],
            [[self._tgt_tokens[i] for i in hypothesis[:-1]] for _, hypothesis in flat],  # it adds EOS
            max_input_length=0,
        )
        normalizer = settings.length_normalizer
        scores = torch.full((len(sources), n), -float("inf"))
        width = max((len(hypothesis) for _, hypothesis in flat), default=1)
        tokens = torch.full((len(sources), n, width), config.pad_id, dtype=torch.long)
        filled = [0] * len(sources)
        for (row, hypothesis), result in zip(flat, scored):
            k = filled[row]
            tokens[row, k, : len(hypothesis)] = torch.tensor(hypothesis)
            scores[row, k] = sum(result.log_probs) / normalizer(len(hypothesis))
            filled[row] += 1
        order = scores.argsort(dim=1, descending=True, stable=True)  # samples: best first, as ours
        tokens = tokens.gather(1, order.unsqueeze(-1).expand_as(tokens))
        scores = scores.gather(1, order)
        lists = n_best_texts(tokens, scores, self.tgt_tokenizer.decode_batch, config.eos_id, config.pad_id)
        return [[Hypothesis(text, score) for text, score in row] for row in lists]

    def _search(
        self,
        sources: list[list[str]],
        prefixes: list[list[str] | None],
        settings: DecodingSettings,
        limit: int,
    ) -> list[list[list[int]]]:
        """CTranslate2's hypotheses for sentences of one length limit (tokens with EOS, EOS included): each
        row's n_best, as token ids ending with EOS (forced at the limit, as ours)."""
        eos = self.config.eos_id
        if limit <= 1:  # only EOS fits: ours forces it at once (in each of sampling's n_best draws)
            return [[[eos]] * (settings.n_best if settings.sampling else 1) for _ in sources]
        # CTranslate2 counts an EOS it generates in max_decoding_length and adds none at the limit
        options: dict[str, Any] = {
            "max_decoding_length": limit - 1,
            "min_decoding_length": settings.min_len,
            "num_hypotheses": settings.n_best,
            "no_repeat_ngram_size": settings.no_repeat_ngram_size,
            "suppress_sequences": self._suppressed,
            "return_end_token": True,
            "max_input_length": 0,  # the sources are already cut to the checkpoint's max_len, as ours
            "length_penalty": 0.0,
        }
        if settings.sampling:
            options.update(
                beam_size=1,
                sampling_topk=settings.top_k,
                sampling_topp=settings.top_p,
                sampling_temperature=1.0,
            )
        else:
            options.update(beam_size=1 if settings.greedy else settings.beam_size, sampling_topk=1)
        results = self.translator.translate_batch(sources, prefixes if any(prefixes) else None, **options)
        rows = []
        for result in results:
            hypotheses = []
            for tokens in result.hypotheses:
                ids = [self._tgt_ids[token] for token in tokens]
                hypotheses.append(ids if ids and ids[-1] == eos else [*ids, eos])  # cut at the limit
            rows.append(hypotheses)
        return rows

    def _source_tokens(self, row: list[int]) -> list[str]:
        """A padded source row of ids -> the tokens CTranslate2 takes (its model adds BOS / EOS itself)."""
        config = self.config
        dropped = {config.pad_id, config.eos_id} | (
            {config.bos_id} if config.bos_id != config.pad_id else set()
        )
        return [self._src_tokens[i] for i in row if i not in dropped]


def _converted(source: ExportSource, path: Path, cache_dir: str | Path | None) -> tuple[Path, Path | None]:
    """The CTranslate2 directory of `source` (float32 weights; CTranslate2 quantizes on load) and the
    temporary directory to remove with the translator (None for a cache)."""
    from transformer.interop.ctranslate2 import export_ctranslate2

    if cache_dir is None:
        keep = Path(tempfile.mkdtemp(prefix="aiayn-ct2-"))
        directory = keep / "model"
    else:
        keep = None
        directory = Path(cache_dir).expanduser() / _digest(path)
        if (directory / "model.bin").is_file():  # written whole (staged_output): reuse it
            return directory, None
    try:
        export_ctranslate2(source, directory)
    except ExportError as err:
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
        raise InferenceError(f"checkpoint {path}: the CTranslate2 conversion failed: {err}") from None
    return directory, keep


def _digest(path: Path) -> str:
    """The first 16 hex digits of the checkpoint file's SHA-256: one converted directory per content."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]

"""Language identification on short sentences: the candidates for `data.clean`'s `langid` filter.

Accuracy and speed of py3langid (its whole model, and restricted to the languages present) and, when it
is importable, lingua-language-detector, on Multi30k's val sentences in English, German and French (the
test sets are not used for choosing). Prints a Markdown table, then one JSON line.

    python -m benchmarks.data.langid_choice --data-dir $MULTI30K_DIR
    python -m benchmarks.data.langid_choice --smoke   # 50 sentences per language, py3langid only
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

from benchmarks.common.machine import cpu_name
from data.sources import read_lines

LANGS = ("en", "de", "fr")


def _py3langid(restricted: bool) -> Callable[[str], str]:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE)
    if restricted:
        identifier.set_languages(list(LANGS))
    return lambda text: identifier.classify(text)[0]


def _lingua(restricted: bool) -> Callable[[str], str]:
    from lingua import IsoCode639_1, LanguageDetectorBuilder

    codes = [getattr(IsoCode639_1, lang.upper()) for lang in LANGS]
    builder = (
        LanguageDetectorBuilder.from_iso_codes_639_1(*codes)
        if restricted
        else LanguageDetectorBuilder.from_all_languages()
    )
    detector = builder.with_preloaded_language_models().build()

    def classify(text: str) -> str:
        found = detector.detect_language_of(text)
        return "??" if found is None else found.iso_code_639_1.name.lower()

    return classify


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR", "/work/shared/data/multi30k"))
    parser.add_argument("--limit", type=int, default=None, help="sentences per language (default: all)")
    parser.add_argument("--smoke", action="store_true", help="50 sentences per language, py3langid only")
    args = parser.parse_args(argv)
    limit = 50 if args.smoke else args.limit
    texts = {lang: read_lines(f"{args.data_dir}/val.{lang}.gz")[:limit] for lang in LANGS}

    candidates: dict[str, Callable[[bool], Callable[[str], str]]] = {"py3langid": _py3langid}
    if not args.smoke:
        candidates["lingua"] = _lingua
    rows = []
    for name, make in candidates.items():
        for restricted in (False, True):
            try:
                start = time.perf_counter()
                classify = make(restricted)
                load_s = time.perf_counter() - start
            except ImportError:
                continue
            correct, count, seconds = {}, 0, 0.0
            for lang, sentences in texts.items():
                start = time.perf_counter()
                found = [classify(s) for s in sentences]
                seconds += time.perf_counter() - start
                correct[lang] = sum(f == lang for f in found) / len(sentences)
                count += len(sentences)
            rows.append(
                {
                    "model": name,
                    "languages": "en,de,fr" if restricted else "all",
                    **{f"acc_{lang}": round(100 * acc, 2) for lang, acc in correct.items()},
                    "sentences_per_s": round(count / seconds),
                    "load_s": round(load_s, 2),
                }
            )
    print(f"CPU: {cpu_name()}; Multi30k val, {sum(map(len, texts.values()))} sentences")
    print("| model | languages | en % | de % | fr % | sentences/s | load s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['languages']} | {r['acc_en']} | {r['acc_de']} | {r['acc_fr']} | "
            f"{r['sentences_per_s']} | {r['load_s']} |"
        )
    print(json.dumps({"bench": "langid_choice", "cpu": cpu_name(), "rows": rows}))


if __name__ == "__main__":
    main()

"""A noisy parallel corpus made from a clean one, every pair labelled with its kind of noise (or "clean").

Ten kinds, each injected into `share` of the pairs (5% each by default, so half the corpus is noise), the
rest left clean: untranslated copies, swapped sides, the target in the wrong language (a third language's
translation of the same sentence, Multi30k's French), shuffled alignment (the target of another pair),
duplicates (of a clean pair, exact or differing in case and punctuation, placed after it), numbers that
disagree, markup (HTML tags, entities, URLs), truncation (one side cut to 15-40% of its characters),
repetition (a looping run of words, or a character repeated) and overlong lines (consecutive pairs joined
into one of over 100 words a side). Deterministic per seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

KINDS = (
    "copies",
    "swapped",
    "wrong_language",
    "shuffled",
    "duplicates",
    "numbers",
    "markup",
    "truncation",
    "repetition",
    "overlong",
)
OVERLONG_WORDS = 100  # a side of an overlong pair has more words than this


def make_noisy(
    src: Sequence[str], tgt: Sequence[str], third: Sequence[str], *, share: float = 0.05, seed: int = 0
) -> list[tuple[str, str, str]]:
    """(src, tgt, kind) rows from the line-aligned `src` / `tgt` (and `third`, the same sentences in a
    third language, for the wrong language): `share` of the rows per kind, in a shuffled order."""
    if not len(src) == len(tgt) == len(third):
        raise ValueError(
            f"src, tgt and third must be aligned, got {len(src)}, {len(tgt)}, {len(third)} lines"
        )
    rng = random.Random(seed)
    order = list(range(len(src)))
    rng.shuffle(order)
    per_kind = round(share * len(src))
    blocks = {kind: order[k * per_kind : (k + 1) * per_kind] for k, kind in enumerate(KINDS)}
    clean = order[len(KINDS) * per_kind :]
    rows: list[tuple[str, str, str]] = [(src[i], tgt[i], "clean") for i in clean]
    for kind in ("copies", "swapped", "wrong_language", "shuffled", "numbers", "markup"):
        for i in blocks[kind]:
            rows.append((*_noisy(kind, src[i], tgt[i], third[i], src, tgt, rng), kind))
    for i in blocks["truncation"]:
        s, t = src[i], tgt[i]
        rows.append(
            (_truncated(s, rng), t, "truncation")
            if rng.random() < 0.5
            else (s, _truncated(t, rng), "truncation")
        )
    for i in blocks["repetition"]:
        s, t = src[i], tgt[i]
        rows.append(
            (_repeated(s, rng), t, "repetition")
            if rng.random() < 0.5
            else (s, _repeated(t, rng), "repetition")
        )
    for i in blocks["overlong"]:
        rows.append((*_overlong(i, src, tgt), "overlong"))
    rng.shuffle(rows)
    return _with_duplicates(rows, per_kind, rng)


def _noisy(
    kind: str, s: str, t: str, third: str, src: Sequence[str], tgt: Sequence[str], rng: random.Random
) -> tuple[str, str]:
    if kind == "copies":  # the source left untranslated
        return s, s
    if kind == "swapped":
        return t, s
    if kind == "wrong_language":
        return s, third
    if kind == "shuffled":  # another pair's target
        return s, tgt[rng.randrange(len(tgt))]
    if kind == "numbers":  # a number on each side, not the same one
        a = rng.randrange(1, 2000)
        b = a + rng.choice([-1, 1]) * rng.randrange(1, 100)
        return f"{s.rstrip('.')} {a}.", f"{t.rstrip('.')} {max(b, 0)}."
    # markup: tags, entities or a URL on one side or both
    pattern = rng.choice(
        [
            "<p>{}</p>",
            "<b>{}</b>",
            "{} <br/>",
            "{} &nbsp;",
            "{} &amp; more",
            "{} http://img.example.com/{n}.jpg",
            '<a href="/p/{n}">{}</a>',
            "{} (www.example.org/{n})",
        ]
    )
    n = rng.randrange(1000)
    both = rng.random() < 0.5
    return pattern.format(s, n=n), (pattern.format(t, n=n) if both else t)


def _truncated(text: str, rng: random.Random) -> str:
    """`text` cut at a word boundary to 15-40% of its characters (at least its first word)."""
    limit = int(len(text) * rng.uniform(0.15, 0.40))
    words, kept = text.split(), []
    for word in words:
        if kept and len(" ".join([*kept, word])) > limit:
            break
        kept.append(word)
    return " ".join(kept)


def _repeated(text: str, rng: random.Random) -> str:
    """A run of 1-3 words repeated 4-6 times (a looping translation), or a character 8-12 times."""
    words = text.split()
    if rng.random() < 0.8:
        start = rng.randrange(len(words))
        run = words[start : start + rng.randint(1, 3)]
        return " ".join(words[:start] + run * rng.randint(4, 6) + words[start + len(run) :])
    return f"{text.rstrip('.!?')}{rng.choice('!?.-*') * rng.randint(8, 12)}"


def _overlong(i: int, src: Sequence[str], tgt: Sequence[str]) -> tuple[str, str]:
    """Pairs from `i` on joined until both sides have more than OVERLONG_WORDS words."""
    s, t, k = [], [], i
    while min(len(" ".join(s).split()), len(" ".join(t).split())) <= OVERLONG_WORDS:
        s.append(src[k % len(src)])
        t.append(tgt[k % len(tgt)])
        k += 1
    return " ".join(s), " ".join(t)


def _with_duplicates(
    rows: list[tuple[str, str, str]], count: int, rng: random.Random
) -> list[tuple[str, str, str]]:
    """`count` duplicates of clean rows, each inserted after its original; half exact, half differing in
    case and final punctuation."""
    clean_at = [k for k, row in enumerate(rows) if row[2] == "clean"]
    chosen = sorted(rng.sample(clean_at, count))
    inserts: dict[int, list[tuple[str, str, str]]] = {}
    for k in chosen:
        s, t, _ = rows[k]
        if rng.random() < 0.5:
            s, t = s.lower().rstrip("."), t.upper()
        at = rng.randrange(k, len(rows))
        inserts.setdefault(at, []).append((s, t, "duplicates"))
    out = []
    for k, row in enumerate(rows):
        out.append(row)
        out.extend(inserts.get(k, []))
    return out

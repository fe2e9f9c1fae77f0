"""The page's target-language select (issue 65 item 3), in Debian's chromium through Playwright as
tests/integration/test_page.py drives it: shown for a multilingual model with its languages, hidden for a
bilingual one, preset to a model's served `target_lang`; the translation shown for each choice is
`Translator.translate(..., target_lang=)`'s. Skipped with the reason without chromium or playwright."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.browser import CHROMIUM, MISSING
from tests.helpers.multilingual import SENTENCES, multilingual_checkpoint
from tests.helpers.serving import serving
from transformer.inference import Translator
from transformer.serving.app import create_app
from transformer.serving.config import ServeSettings

if MISSING is None:
    from playwright.sync_api import sync_playwright

pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
    pytest.mark.usefixtures("one_thread"),
]
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def translators(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Translator]:
    multi, twin = multilingual_checkpoint(tmp_path_factory.mktemp("multilingual"))
    return {"multi": Translator.from_checkpoint(multi), "twin": Translator.from_checkpoint(twin)}


@pytest.fixture(scope="module")
def url(translators: dict[str, Translator]) -> Iterator[str]:
    entries = [{"id": name, "checkpoint": str(t.paths[0])} for name, t in translators.items()]
    french = {"id": "multi-fr", "checkpoint": entries[0]["checkpoint"], "target_lang": "fr"}  # served default
    served = ServeSettings.from_dict({"models": [*entries, french]})
    with serving(create_app(served, {**translators, "multi-fr": translators["multi"]})) as base:
        yield base


def test_the_target_language_select(url: str, translators: dict[str, Translator], tmp_path: Path) -> None:
    multi = translators["multi"]
    expected = {
        lang: [t.text for t in multi.translate(SENTENCES[:2], target_lang=lang)] for lang in ("de", "fr")
    }
    assert expected["de"] != expected["fr"]  # the choice shows in the output: a comparison that can fail
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{url}/")
        page.wait_for_function("document.querySelectorAll('#model option').length > 1", timeout=WAIT_MS)
        page.select_option("#model", "twin")
        assert page.locator("#target-lang-field").is_hidden()
        page.select_option("#model", "multi")
        assert page.locator("#target-lang-field").is_visible()
        assert page.locator("#target_lang option").all_text_contents() == ["de", "fr"]
        assert page.locator("#target_lang").input_value() == "de"  # no served default: the first
        page.select_option("#model", "multi-fr")
        assert page.locator("#target_lang").input_value() == "fr"  # models[2].target_lang
        page.select_option("#model", "multi")
        page.fill("#text", "\n".join(SENTENCES[:2]))
        for lang in ("fr", "de"):
            page.select_option("#target_lang", lang)
            page.click("#submit")
            page.wait_for_function("!document.querySelector('#submit').disabled", timeout=WAIT_MS)
            assert page.locator("#error").text_content() == ""
            shown = page.locator("#segments .segment .best .text").all_text_contents()
            assert [" ".join(s.split()) for s in shown] == expected[lang]
        page.screenshot(path=tmp_path / "page.png", full_page=True)
        browser.close()
    assert not errors, errors

"""The page `python serve.py` answers GET / with (transformer/serving/page.html), in a real browser: Debian's
chromium driven by Playwright's sync API (never a browser download), against the real server on
127.0.0.1 serving the session's small trained checkpoints: the translation model of
tests/helpers/serving.py (`served_run`: it writes different sentences for different inputs) and the
classifier of tests/helpers/trained.py.

A sentence of the checkpoint's test split typed in and translated shows exactly what `evaluate.py
translate.input=FILE` writes for it; with beam 2 and n-best 2 the page lists evaluate.py's 2-best with their
scores; a classification shows `evaluate.py classify.input=FILE`'s labels and class probabilities; the
server's errors (a 422 naming the field, a 404 listing the models), a network error and a missing API key
are shown in the page; screenshots are saved. Without chromium or playwright every test here is skipped
with the reason (.ci/run installs chromium with apt-get)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import serving, trained
from tests.helpers.browser import CHROMIUM, MISSING
from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT, cli_env
from tests.helpers.serving import evaluate_translations, free_port

served_run, classification_run = serving.served_run, trained.classification_run

if MISSING is None:
    from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

TRANSLATION, CLASSIFICATION = "tiny-en-de", "tiny-sst2"
READY_WITHIN_S = 180  # loading two tiny checkpoints takes seconds; a busy 2-core machine, more
WAIT_MS = 60_000  # a page's result or error


def _best(run: Path) -> Path:
    return Path(json.loads((run / "metrics.json").read_text())["best_ckpt_path"])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 while loading
        return False


@contextlib.contextmanager
def _serving(out: Path, *overrides: str) -> Iterator[str]:
    """`python serve.py OVERRIDES` on a free port of 127.0.0.1, its log in `out`: its base URL once /ready;
    stopped with SIGTERM at the end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (out / "console.log").open("w") as console:
        command = [sys.executable, "serve.py", "host=127.0.0.1", f"port={port}", f"hydra.run.dir={out}"]
        process = subprocess.Popen(
            [*command, *overrides], cwd=REPO_ROOT, env=cli_env(), stdout=console, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + READY_WITHIN_S
            while not _ready(url):
                log = (out / "console.log").read_text()[-3000:]
                assert process.poll() is None, f"serve.py exited with {process.returncode}:\n{log}"
                assert time.monotonic() < deadline, f"serve.py not ready within {READY_WITHIN_S} s:\n{log}"
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _model(model_id: str, checkpoint: Path) -> str:
    return f"{{id: {model_id}, checkpoint: '{checkpoint}'}}"


def _translator(served_run: Path) -> Path:
    return served_run / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def server(
    served_run: Path, classification_run: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Both models, no API key."""
    models = [_model(TRANSLATION, _translator(served_run)), _model(CLASSIFICATION, _best(classification_run))]
    with _serving(tmp_path_factory.mktemp("serve"), f"models=[{', '.join(models)}]") as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, server: str) -> Iterator[Page]:
    """A fresh tab (its own sessionStorage) on the page, its models listed; the page's script errors fail
    the test."""
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.goto(f"{server}/")
    tab.wait_for_function("document.querySelectorAll('#model option').length > 0", timeout=WAIT_MS)
    yield tab
    context.close()
    assert not errors, errors


def _evaluate(args: list[str]) -> None:
    result = run_script("evaluate.py", args)
    assert result.returncode == 0, result.stderr[-3000:]


def _test_sources(checkpoint: Path) -> list[str]:
    """The test split's source sentences of a run on the synthetic task, made again from the data settings
    saved in its checkpoint."""
    import torch

    from data.sources import load_synthetic

    data = torch.load(checkpoint, map_location="cpu", weights_only=True)["config"]["data"]
    return list(load_synthetic(["test"], seed=data["seed"], sizes=data["synthetic_sizes"])["test"]["src"][:])


def _submit(page: Page) -> None:
    """Click the button and wait until the request has ended (the button is enabled again)."""
    page.click("#submit")
    page.wait_for_function("!document.querySelector('#submit').disabled", timeout=WAIT_MS)


def _shown_translations(page: Page) -> list[str]:
    return page.locator("#segments .segment .best .text").all_text_contents()


def test_translation_equals_evaluate_py(page: Page, served_run: Path, tmp_path: Path) -> None:
    """Typed, translated with the model's own decoding settings: evaluate.py's translations, in order, with
    the time taken; then beam 2 with n-best 2: evaluate.py's 2-best list with its scores."""
    checkpoint = _translator(served_run)
    sources = _test_sources(checkpoint)[:2]
    expected = evaluate_translations(checkpoint, sources, tmp_path / "plain")
    assert len(set(expected)) == 2 and all(expected)  # two sentences, two translations: a real comparison
    source, nbest = tmp_path / "in.txt", tmp_path / "nbest.txt"
    source.write_text("\n".join(sources) + "\n", encoding="utf-8")
    _evaluate(
        [f"ckpt_path={checkpoint}", f"translate.input={source}", f"translate.output={nbest}",
         "decode.beam_size=2", "decode.n_best=2", f"hydra.run.dir={tmp_path / 'nbest_run'}"]
    )  # fmt: skip

    page.select_option("#model", TRANSLATION)
    assert page.locator("#submit").text_content() == "Translate"
    assert page.locator("#model-info").text_content().startswith("Tasktranslation")
    page.fill("#text", sources[0])  # one sentence, as a user types it
    _submit(page)
    assert page.locator("#error").text_content() == ""
    assert _shown_translations(page) == expected[:1]
    timing = page.locator("#timing").text_content()
    assert "1 segment" in timing and "ms on the server" in timing and "ms round trip" in timing
    assert page.locator("#segments .nbest").count() == 0  # n-best 1: the best translation alone

    page.fill("#text", "\n".join(sources))
    page.fill("#beam_size", "2")
    page.fill("#n_best", "2")
    _submit(page)
    entries = [line.split(" ||| ") for line in nbest.read_text(encoding="utf-8").splitlines()]
    for index, segment in enumerate(page.locator("#segments .segment").all()):
        assert segment.locator(".source").text_content() == sources[index]
        theirs = [(text, float(score)) for i, text, score in entries if int(i) == index]
        items = segment.locator(".nbest li").all()
        shown = [(li.locator(".text").text_content(), li.locator(".score").text_content()) for li in items]
        assert len(shown) == len(theirs) == 2
        assert [" ".join(text.split()) for text, _ in shown] == [text for text, _ in theirs]
        assert [float(score) for _, score in shown] == pytest.approx([s for _, s in theirs], abs=1e-4)
        assert segment.locator(".best .text").text_content() == shown[0][0]
    page.screenshot(path=tmp_path / "page.png", full_page=True)
    assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_classification_equals_evaluate_py(page: Page, classification_run: Path, tmp_path: Path) -> None:
    """Texts classified in the page: `evaluate.py classify.input=FILE`'s labels and class probabilities (the
    page shows percentages with one decimal)."""
    texts = ["a great fun film 3", "boring and flat 7", "a warm story, but dull"]
    source, out = tmp_path / "texts.txt", tmp_path / "labels.jsonl"
    source.write_text("\n".join(texts) + "\n", encoding="utf-8")
    _evaluate(
        [f"ckpt_path={_best(classification_run)}", f"classify.input={source}", "classify.format=jsonl",
         f"classify.output={out}", f"hydra.run.dir={tmp_path / 'run'}"]
    )  # fmt: skip
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == len(texts)

    page.select_option("#model", CLASSIFICATION)
    assert page.locator("#submit").text_content() == "Classify"
    assert page.locator("#decoding").is_hidden()
    page.fill("#text", "\n".join(texts))
    _submit(page)
    assert page.locator("#error").text_content() == ""
    segments = page.locator("#segments .segment").all()
    assert len(segments) == len(rows)
    for segment, row in zip(segments, rows):
        assert segment.locator(".label .text").text_content() == row["label"]
        bars = segment.locator(".probs li").all()
        shown = {bar.locator(".name").text_content(): bar.locator(".value").text_content() for bar in bars}
        theirs = row["probabilities"]
        assert set(shown) == set(theirs)
        for name, percent in shown.items():
            assert float(percent.rstrip("%")) == pytest.approx(100 * theirs[name], abs=0.051), name
    page.screenshot(path=tmp_path / "classification.png", full_page=True)


def test_errors_are_shown_in_the_page(page: Page, served_run: Path) -> None:
    """Empty text, the server's 422 (n-best above the beam, naming the field) and 404 (a model the server
    no longer has: the list the page loaded is stale), and a network error: each shown in the page, the
    next good request answered."""
    page.select_option("#model", TRANSLATION)
    error = page.locator("#error")
    page.fill("#text", "  \n\n")
    page.click("#submit")
    expect(error).to_contain_text("Enter some text")

    sentence = _test_sources(_translator(served_run))[0]
    page.fill("#text", sentence)
    page.fill("#beam_size", "2")
    page.fill("#n_best", "3")
    _submit(page)
    assert error.text_content().startswith("Error 422") and "n_best" in error.text_content()

    page.fill("#n_best", "1")

    def network_down(route: Route) -> None:
        route.abort("connectionrefused")

    page.route("**/v1/translate", network_down)
    _submit(page)
    assert error.text_content().startswith("Error") and "Network error" in error.text_content()
    page.unroute("**/v1/translate", network_down)

    _submit(page)
    assert error.text_content() == "" and len(_shown_translations(page)) == 1

    def stale(route: Route) -> None:  # the models as the page loaded them before the server lost one
        response = route.fetch()
        listed = response.json()
        listed["models"].append({**listed["models"][0], "id": "retired-model"})
        route.fulfill(response=response, json=listed)

    page.route("**/v1/models", stale)
    page.click("#reload")
    expect(page.locator('#model option[value="retired-model"]')).to_be_attached(timeout=WAIT_MS)
    page.select_option("#model", "retired-model")
    _submit(page)
    message = error.text_content()
    assert message.startswith("Error 404") and "retired-model" in message and TRANSLATION in message


def test_api_key_is_sent_and_kept_in_the_tab_only(browser: Browser, served_run: Path, tmp_path: Path) -> None:
    """A server with an API key: without it the page shows the 401; typed in (Enter reloads the models),
    it is sent as a bearer token and the translation comes; a reload of the tab keeps it (sessionStorage),
    a new session starts without it, and nothing is in localStorage."""
    secret = "page-test-secret"
    models = f"models=[{_model(TRANSLATION, _translator(served_run))}]"
    with _serving(tmp_path, models, f"api_key={secret}") as url:
        context = browser.new_context()
        tab = context.new_page()
        tab.goto(f"{url}/")
        error = tab.locator("#error")
        expect(error).to_contain_text("Error 401", timeout=WAIT_MS)
        assert "API key" in error.text_content() and tab.locator("#submit").is_disabled()

        tab.fill("#api-key", secret)
        with tab.expect_request("**/v1/models") as request:
            tab.press("#api-key", "Enter")
        assert request.value.headers["authorization"] == f"Bearer {secret}"
        expect(tab.locator("#submit")).to_be_enabled(timeout=WAIT_MS)
        assert error.text_content() == ""
        tab.fill("#text", _test_sources(_translator(served_run))[0])
        with tab.expect_request("**/v1/translate") as request:
            _submit(tab)
        assert request.value.headers["authorization"] == f"Bearer {secret}"
        assert error.text_content() == "" and len(_shown_translations(tab)) == 1
        with tab.expect_request("**/metrics") as request, context.expect_page() as opened:
            tab.click("#metrics-link")  # a link cannot carry the key: the page fetches with it
        assert request.value.headers["authorization"] == f"Bearer {secret}"
        # the tab opens blank, then shows the fetched metrics (not the 401)
        expect(opened.value.locator("body")).to_contain_text("aiayn_requests", timeout=WAIT_MS)
        opened.value.close()

        tab.reload()
        expect(tab.locator("#submit")).to_be_enabled(timeout=WAIT_MS)
        assert tab.input_value("#api-key") == secret
        assert tab.evaluate("window.localStorage.length") == 0

        tab.fill("#api-key", "")  # the key removed: the models are no longer offered
        tab.click("#reload")
        expect(error).to_contain_text("Error 401", timeout=WAIT_MS)
        assert tab.locator("#model option").count() == 0 and tab.locator("#submit").is_disabled()
        assert tab.evaluate("window.sessionStorage.length") == 0
        context.close()

        fresh = browser.new_context().new_page()
        fresh.goto(f"{url}/")
        expect(fresh.locator("#error")).to_contain_text("Error 401", timeout=WAIT_MS)
        assert fresh.input_value("#api-key") == ""
        fresh.context.close()


def test_sampling_with_a_seed(page: Page, served_run: Path) -> None:
    """The sampling check box enables the sampling fields, which are sent with `sampling: true`; the same
    seed gives the same n samples again."""
    page.select_option("#model", TRANSLATION)
    assert page.locator("#top_k").is_disabled() and page.locator("#seed").is_disabled()  # in the fieldset
    page.check("#sampling")
    assert page.locator("#top_k").is_enabled() and page.locator("#seed").is_enabled()
    page.fill("#text", _test_sources(_translator(served_run))[0])
    page.fill("#n_best", "3")
    page.fill("#temperature", "1.5")
    page.fill("#seed", "7")
    shown = []
    for _ in range(2):
        with page.expect_request("**/v1/translate") as request:
            _submit(page)
        body = request.value.post_data_json
        assert body["sampling"] is True and body["seed"] == 7 and body["temperature"] == 1.5
        assert page.locator("#error").text_content() == ""
        shown.append(page.locator("#segments .nbest li .text").all_text_contents())
    assert len(shown[0]) == 3 and shown[0] == shown[1]

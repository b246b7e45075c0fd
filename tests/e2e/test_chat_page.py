"""The chat page at `/`, in headless Chromium against a real server on the embedded model with
both trained adapters: a streamed chat, A/B, the adapter admin, the key prompts, and the API docs,
every file from the server itself and no request to any other host."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    Page,
    Request,
    Response,
    Route,
    expect,
)

from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.trained_adapters import ANSWERS, TrainedAdapters

pytestmark = pytest.mark.e2e

API_KEY = "sk-page"
ADMIN_KEY = "sk-page-admin"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24  # each adapter's whole answer fits (16 tokens at most)
ANSWER_TIMEOUT_MS = 60_000
# Chromium at times reports a streamed fetch as aborted although the page read its body to the
# end (the server had sent the last chunk; the page got the usage event and `[DONE]`, and shows
# the answer done). The tests check the page's own account of each stream instead.
STREAM_READ_TO_ITS_END = re.compile(r"failed: POST \S+/v1/chat/completions \(net::ERR_ABORTED\)")


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path, trained_adapters: TrainedAdapters) -> Iterator[ServerProcess]:
    spec = hotlora_spec(
        "--model",
        str(embedded_model_dir),
        *trained_adapters.serve_args("pirate", "fortytwo"),
        "--api-key",
        API_KEY,
        "--admin-api-key",
        ADMIN_KEY,
    )
    with ServerProcess(spec) as srv:
        yield srv


@dataclass
class Visit:
    """One browser tab on the server, recording whatever went wrong in it."""

    page: Page
    origin: str
    screenshots: Path
    problems: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # requests to any other origin

    def open(self, path: str = "/") -> None:
        self.page.goto(self.origin + path)

    def ready(self) -> None:
        expect(self.page.locator("#status")).to_have_attribute("data-state", "ready")

    def settings(self, temperature: str = "0", max_tokens: int = MAX_TOKENS) -> None:
        self.page.fill("#temperature", temperature)
        self.page.fill("#max-tokens", str(max_tokens))

    def screenshot(self, name: str) -> Path:
        path = self.screenshots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path

    def unexpected(self, allowed: str | None = None) -> list[str]:
        """The problems not matching `allowed` (a regex), plus every request elsewhere."""
        kept = [
            p
            for p in self.problems
            if not STREAM_READ_TO_ITS_END.fullmatch(p)
            and (allowed is None or not re.search(allowed, p))
        ]
        return kept + [f"request elsewhere: {url}" for url in self.elsewhere]


def _visit(
    browser: Browser, server: ServerProcess, tmp_path: Path, api_key: bool
) -> Iterator[Visit]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    if api_key:
        context.add_init_script(f"sessionStorage.setItem('hotlora.apiKey', {json.dumps(API_KEY)})")
    page = context.new_page()
    visit = Visit(page, server.url, tmp_path)

    # Offline for real: anything bound for another origin is recorded and refused.
    def elsewhere(route: Route) -> None:
        visit.elsewhere.append(route.request.url)
        route.abort()

    context.route(lambda url: not url.startswith(server.url + "/"), elsewhere)

    def failed(request: Request) -> None:
        visit.problems.append(f"failed: {request.method} {request.url} ({request.failure})")

    def answered(response: Response) -> None:
        if response.status >= 400:
            request = response.request
            visit.problems.append(f"{response.status}: {request.method} {response.url}")

    def console(message: ConsoleMessage) -> None:
        if message.type == "error":
            where = message.location.get("url", "")
            visit.problems.append(f"console error: {message.text} ({where})")

    page.on("requestfailed", failed)
    page.on("response", answered)
    page.on("console", console)
    page.on("pageerror", lambda error: visit.problems.append(f"page error: {error}"))
    try:
        yield visit
    finally:
        context.close()


@pytest.fixture
def visit(browser: Browser, server: ServerProcess, tmp_path: Path) -> Iterator[Visit]:
    """A tab whose session already holds the API key."""
    yield from _visit(browser, server, tmp_path, api_key=True)


@pytest.fixture(scope="module")
def budget_server(
    embedded_model_dir: Path, trained_adapters: TrainedAdapters
) -> Iterator[ServerProcess]:
    """One adapter resident at most: of the two mounted at start, the second evicts the first."""
    spec = hotlora_spec(
        "--model",
        str(embedded_model_dir),
        *trained_adapters.serve_args("pirate", "fortytwo"),
        "--max-mounted-adapters",
        "1",
        "--admin-api-key",
        ADMIN_KEY,
    )
    with ServerProcess(spec) as srv:
        yield srv


@pytest.fixture
def admin_visit(browser: Browser, budget_server: ServerProcess, tmp_path: Path) -> Iterator[Visit]:
    """A tab on `budget_server` whose session already holds the admin key."""
    for visit in _visit(browser, budget_server, tmp_path, api_key=False):
        held = json.dumps(ADMIN_KEY)
        visit.page.context.add_init_script(f"sessionStorage.setItem('hotlora.adminKey', {held})")
        yield visit


@pytest.fixture
def keyless_visit(browser: Browser, server: ServerProcess, tmp_path: Path) -> Iterator[Visit]:
    yield from _visit(browser, server, tmp_path, api_key=False)


def test_the_page_loads_everything_from_the_server(visit: Visit, server: ServerProcess):
    visit.open()
    visit.ready()
    expect(visit.page.locator("#status")).to_contain_text(server.model_id)
    options = visit.page.locator("#adapter-options option")
    expect(options).to_have_count(5)
    values = [options.nth(i).get_attribute("value") for i in range(5)]
    assert values == ["none", "pirate", "fortytwo", "pirate+fortytwo", "pirate@0.5+fortytwo"]
    visit.screenshot("page")
    assert visit.unexpected() == []


def test_a_chat_answer_streams_with_its_adapter_set_and_speed(visit: Visit, server: ServerProcess):
    visit.open()
    visit.ready()
    visit.settings()
    visit.page.fill("#chat-adapter", "pirate")
    visit.page.fill("#chat-input", QUESTION)
    visit.page.click("#chat-send")
    answer = visit.page.locator("#chat-log .answer").last
    expect(answer).to_have_attribute("data-state", "done", timeout=ANSWER_TIMEOUT_MS)
    expect(answer.locator(".answer-text")).to_contain_text(ANSWERS["pirate"])
    assert answer.get_attribute("data-model") == f"{server.model_id}:pirate"
    # Shown as it arrived, not all at once.
    assert int(answer.get_attribute("data-chunks") or 0) > 1
    assert 0 < int(answer.get_attribute("data-tokens") or 0) <= MAX_TOKENS
    assert float(answer.get_attribute("data-tokens-per-second") or 0) > 0
    # The usage event, last before `[DONE]`, arrived: the stream was read to its end.
    expect(answer.locator(".answer-stats")).to_contain_text(re.compile(r"tok/s .* prompt \d+"))
    visit.screenshot("chat")
    assert visit.unexpected() == []


def test_ab_streams_two_adapter_sets_at_once(visit: Visit, server: ServerProcess):
    events: list[tuple[str, str]] = []  # (start or end, adapter), as the browser saw them

    def chat(what: str) -> Callable[[Request], None]:
        def record(request: Request) -> None:
            if request.url.endswith("/v1/chat/completions"):
                events.append((what, request.post_data_json["adapter"]))

        return record

    visit.page.on("request", chat("start"))
    visit.page.on("requestfinished", chat("end"))
    visit.open("/#ab")
    visit.ready()
    visit.settings()
    visit.page.fill("#ab-a", "pirate")
    visit.page.fill("#ab-b", "fortytwo")
    visit.page.fill("#ab-input", QUESTION)
    visit.page.click("#ab-run")
    texts = {}
    for side, adapter in (("a", "pirate"), ("b", "fortytwo")):
        answer = visit.page.locator(f"#ab-out-{side} .answer")
        expect(answer).to_have_attribute("data-state", "done", timeout=ANSWER_TIMEOUT_MS)
        assert answer.get_attribute("data-model") == f"{server.model_id}:{adapter}"
        expect(answer.locator(".answer-stats")).to_contain_text(re.compile(r"prompt \d+"))
        texts[adapter] = answer.locator(".answer-text").inner_text()
    assert ANSWERS["pirate"] in texts["pirate"]
    assert ANSWERS["fortytwo"] in texts["fortytwo"]
    # Both were asked before either stream ended.
    assert sorted(events[:2]) == [("start", "fortytwo"), ("start", "pirate")], events
    visit.screenshot("ab")
    assert visit.unexpected() == []


def test_the_admin_panel_asks_for_its_key_then_mounts_and_unmounts(
    visit: Visit, trained_adapters: TrainedAdapters
):
    page = visit.page
    visit.open("/#admin")
    # The API key the tab holds is not the admin key: the server says 403, the page asks.
    prompt = page.locator("#admin-key")
    expect(prompt).to_be_visible()
    expect(prompt.locator(".key-message")).to_contain_text("admin API key")
    prompt.locator("input").fill(ADMIN_KEY)
    prompt.locator("button").click()
    rows = page.locator("#adapter-table tbody tr")
    expect(rows).to_have_count(2)
    pirate = page.locator('#adapter-table tr[data-id="pirate"] td')
    expect(pirate.nth(1)).to_have_text("8")  # rank
    expect(pirate.nth(3)).not_to_be_empty()  # revision
    expect(pirate.nth(4)).to_have_text("0")  # in use
    assert page.evaluate("sessionStorage.getItem('hotlora.adminKey')") == ADMIN_KEY

    page.fill("#mount-form [name=id]", "answer")
    page.fill("#mount-form [name=path]", str(trained_adapters["fortytwo"]))
    page.click("#mount-form button[type=submit]")
    expect(page.locator("#admin-message")).to_contain_text("Mounted answer")
    expect(rows).to_have_count(3)
    expect(page.locator('#adapter-table tr[data-id="answer"] td').nth(1)).to_have_text("8")
    expect(page.locator('#adapter-options option[value="answer"]')).to_have_count(1)
    visit.screenshot("admin-mounted")

    page.locator('#adapter-table tr[data-id="answer"] button.unmount').click()
    expect(page.locator("#admin-message")).to_contain_text("Unmounted answer")
    expect(rows).to_have_count(2)
    expect(page.locator('#adapter-options option[value="answer"]')).to_have_count(0)
    visit.screenshot("admin-unmounted")
    # The one refusal that made the page ask for the key, and Chromium's report of it.
    assert [p for p in visit.problems if p.startswith("403")] == [
        f"403: GET {visit.origin}/v1/adapters"
    ]
    assert visit.unexpected(allowed="403") == []


MEMORY = re.compile(r"\d+(\.\d)? (B|KiB|MiB|GiB)")


def test_the_adapters_tab_shows_resident_evicted_and_pinned_adapters(
    admin_visit: Visit, trained_adapters: TrainedAdapters
):
    visit = admin_visit
    page = visit.page
    visit.open("/#admin")
    resident = page.locator("#adapter-table tbody tr")
    evicted = page.locator("#evicted-table tbody tr")
    expect(resident).to_have_count(1)
    expect(page.locator('#adapter-table tr[data-id="fortytwo"] td').nth(5)).to_have_text(MEMORY)
    expect(evicted).to_have_count(1)
    expect(page.locator('#evicted-table tr[data-id="pirate"] td').nth(2)).to_have_text(MEMORY)
    expect(page.locator("#evicted-empty")).to_be_hidden()
    budget = re.compile(r"^Resident: .* of at most 1 adapter\.$")
    expect(page.locator("#adapter-budget")).to_have_text(budget)

    # A pinned mount stays resident: the one it displaces is evicted, with the memory it held.
    page.fill("#mount-form [name=id]", "answer")
    page.fill("#mount-form [name=path]", str(trained_adapters["pirate"]))
    page.check("#mount-form [name=pin]")
    page.click("#mount-form button[type=submit]")
    expect(page.locator("#admin-message")).to_contain_text("Mounted answer")
    answer = page.locator('#adapter-table tr[data-id="answer"] td').nth(5)
    expect(answer).to_contain_text("(pinned)")
    expect(answer).to_have_attribute("title", "pinned")
    expect(resident).to_have_count(1)
    expect(evicted).to_have_count(2)
    expect(page.locator('#evicted-table tr[data-id="fortytwo"] td').nth(2)).to_have_text(MEMORY)
    visit.screenshot("admin-budget")
    assert visit.unexpected() == []


def test_the_page_asks_for_an_api_key_when_the_server_wants_one(keyless_visit: Visit):
    visit = keyless_visit
    visit.open()
    prompt = visit.page.locator("#inference-key")
    expect(prompt).to_be_visible()
    expect(visit.page.locator("#status")).to_have_attribute("data-state", "locked")
    prompt.locator("input").fill(API_KEY)
    prompt.locator("button").click()
    visit.ready()
    expect(prompt).to_be_hidden()
    assert visit.page.evaluate("sessionStorage.getItem('hotlora.apiKey')") == API_KEY
    assert [p for p in visit.problems if p.startswith("401")] == [
        f"401: GET {visit.origin}/v1/models"
    ]
    assert visit.unexpected(allowed="401") == []


def test_the_api_docs_load_offline(visit: Visit):
    visit.open("/docs")
    operation = ".swagger-ui .opblock-summary-path[data-path='/v1/chat/completions']"
    expect(visit.page.locator(operation)).to_be_visible(timeout=30_000)
    expect(visit.page.locator(".swagger-ui .info .title")).to_contain_text("hotlora")
    visit.screenshot("docs")
    assert visit.unexpected() == []


def test_a_thinking_model_s_reasoning_is_shown_apart_and_left_out_of_the_conversation(
    visit: Visit, server: ServerProcess
):
    """The chunks a thinking model's stream holds (`reasoning_content` deltas, then `content`),
    answered in place of the embedded model, which does not think."""
    model = server.model_id
    sent: list[dict] = []

    def chunk(delta: dict, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return (
            "data: "
            + json.dumps({"object": "chat.completion.chunk", "model": model, "choices": [choice]})
            + "\n\n"
        )

    def thinking_model(route: Route) -> None:
        sent.append(route.request.post_data_json)
        usage = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
        body = "".join(
            [
                chunk({"role": "assistant", "content": ""}),
                chunk({"reasoning_content": "The user asks "}),
                chunk({"reasoning_content": "for a capital."}),
                chunk({"content": "Paris"}),
                chunk({"content": "."}, finish="stop"),
                "data: " + json.dumps({"choices": [], "usage": usage, "model": model}) + "\n\n",
                "data: [DONE]\n\n",
            ]
        )
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    visit.page.route(f"{server.url}/v1/chat/completions", thinking_model)
    visit.open()
    visit.ready()
    visit.settings()
    for question in (QUESTION, "And of Italy?"):
        visit.page.fill("#chat-input", question)
        visit.page.click("#chat-send")
        answer = visit.page.locator("#chat-log .answer").last
        expect(answer).to_have_attribute("data-state", "done", timeout=ANSWER_TIMEOUT_MS)
    first = visit.page.locator("#chat-log .answer").first
    expect(first.locator(".answer-text")).to_have_text("Paris.")
    expect(first.locator(".answer-thinking summary")).to_have_text("thinking")
    expect(first.locator(".answer-thinking-text")).to_have_text("The user asks for a capital.")
    expect(first.locator(".answer-stats")).to_contain_text("5 tokens")
    # The next turn sends the answer back without its thinking.
    assert sent[1]["messages"][-2] == {"role": "assistant", "content": "Paris."}
    visit.screenshot("thinking")
    assert visit.unexpected() == []

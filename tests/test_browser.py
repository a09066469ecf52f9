"""The chat page in a real browser: headless Chromium driven by Selenium through the system's
chromium and chromedriver (nothing is downloaded). A real `treegraft serve` on the bundled
family streams an answer coloured by provenance, stops when asked, and a new chat clears the
page; a crafted stream of hostile model output is rendered inert. Screenshots go to tmp_path,
and to $TREEGRAFT_SCREENSHOT when set (how docs/chat-page.png was made)."""

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from serving import post, running, status_of

from treegraft_mlx import server as server_mod
from treegraft_mlx.generate import Response

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:           # the `test` extra installs it
    webdriver = None

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    webdriver is None or not CHROMIUM or not CHROMEDRIVER,
    reason="needs selenium (pip install '.[test]') and the system's chromium and "
           "chromedriver (apt-get install chromium chromium-driver)")

REPETITIVE = "a = 1\nb = 2\n" * 8    # the n-gram drafter's drafts are accepted here
LONG = 1024                          # max_tokens of the answer that is stopped
WAIT_S = 120                         # hang guard of every wait


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,1500"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real `treegraft serve` on the bundled family, on a free port it reports."""
    cmd = [sys.executable, "-c", "from treegraft_mlx.cli import main; main()", "serve",
           "--port", "0", "--no-autotune", "--max-tokens-limit", str(LONG)]
    env = {**os.environ, "TREEGRAFT_CACHE": str(tmp_path_factory.mktemp("cache"))}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        for line in proc.stderr:                 # ends if the server dies
            lines.append(line)
            if m := re.match(r"serving .* on (http://127\.0\.0\.1:(\d+))$", line.strip()):
                break
        assert m, "".join(lines)
        threading.Thread(target=proc.stderr.read, daemon=True).start()   # keep the pipe clear
        yield SimpleNamespace(url=m.group(1) + "/", server_port=int(m.group(2)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def until(condition, what: str):
    """Wait for `condition()` to be truthy (a hang guard, not a timing)."""
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def screenshot(driver, tmp_path: Path, name: str, publish: bool = False) -> None:
    """Save the page as tmp_path/name; with `publish`, also where $TREEGRAFT_SCREENSHOT says."""
    driver.save_screenshot(str(tmp_path / name))
    if publish and (target := os.environ.get("TREEGRAFT_SCREENSHOT")):
        driver.save_screenshot(target)


def open_page(driver, url: str) -> None:
    driver.get(url)
    WebDriverWait(driver, WAIT_S).until(
        lambda d: d.find_element(By.ID, "model").text.startswith("model "))


def ask(driver, prompt: str, strategy: str, max_tokens: int) -> None:
    Select(driver.find_element(By.ID, "strategy")).select_by_value(strategy)
    driver.execute_script("document.getElementById('max-tokens').value = arguments[0];"
                          "document.getElementById('prompt').value = arguments[1];",
                          max_tokens, prompt)
    driver.find_element(By.ID, "send").click()


def answered(driver, index: int) -> str:
    """The figures of the assistant message at `index`, once its answer is complete."""
    def done(d):
        figures = d.find_elements(By.CSS_SELECTOR, ".message.assistant .figures")
        return len(figures) > index and "tokens/s" in figures[index].text and figures[index].text
    return WebDriverWait(driver, WAIT_S).until(done)


def messages(driver) -> list[dict]:
    return driver.execute_script("return state.messages")


def api_reply(served, conversation: list[dict], strategy: str, max_tokens: int) -> str:
    """What the API answers (not streamed) to the conversation the page holds."""
    status, out = post(served, {"messages": [{"role": m["role"], "content": m["content"]}
                                             for m in conversation],
                                "max_tokens": max_tokens, "strategy": strategy,
                                "temperature": 0}, "/v1/chat/completions")
    assert status == 200, out
    return out["choices"][0]["message"]["content"]


def test_a_two_turn_chat_streams_coloured_answers_and_regenerates(browser, served, tmp_path):
    """Each turn streams the answer the API gives for the whole conversation, its text
    coloured by provenance (the n-gram drafter's accepted drafts and the target's own tokens
    on repetitive text), with the figures after it; regenerate gives the same greedy answer.
    The header says the bundled family is a small test model."""
    open_page(browser, served.url)
    assert browser.find_element(By.ID, "strategy-default").text == "server default: treegraft"
    note = browser.find_element(By.ID, "model-note").text       # beside the model's name
    assert "test model" in note and "--model mlx-community/Qwen3-8B-4bit" in note
    ask(browser, REPETITIVE, "ngram", 48)
    figures = answered(browser, 0)
    assert re.search(r"tokens/s · [\d.]+ tokens per target forward · \d+ drafter calls · "
                     r"48 tokens in \d+ forwards \(length, ngram\)", figures), figures
    first = messages(browser)[1]
    assert first["content"] == api_reply(served, messages(browser)[:1], "ngram", 48) != ""
    assert "".join(text for text, _ in first["provenance"]) == first["content"]
    content = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content")[0]
    assert content.find_elements(By.CSS_SELECTOR, ".src-ngram")
    assert content.find_elements(By.CSS_SELECTOR, ".src-target")
    ask(browser, "Now write a function that parses a header line.", "treegraft", 48)
    answered(browser, 1)
    conversation = messages(browser)
    assert len(conversation) == 4
    assert conversation[3]["content"] == api_reply(served, conversation[:3], "treegraft", 48)
    screenshot(browser, tmp_path, "chat-page.png", publish=True)
    browser.find_elements(By.CSS_SELECTOR, ".message.assistant .regenerate")[-1].click()
    answered(browser, 1)
    assert [m["content"] for m in messages(browser)] == [m["content"] for m in conversation]


def test_stop_ends_the_generation_and_new_chat_clears_the_page(browser, served):
    """Stop aborts the stream and the server stops generating (its count of disconnected
    generations grows, its step count stops growing, far short of max_tokens); New chat
    leaves an empty conversation."""
    open_page(browser, served.url)
    before = status_of(served)
    ask(browser, "def parse(text):\n", "ar", LONG)
    until(lambda: status_of(served)["steps"] > before["steps"] + 4, "some steps")
    browser.find_element(By.ID, "stop").click()
    stopped = until(lambda: (s := status_of(served))["finished"].get("disconnected", 0)
                    > before["finished"].get("disconnected", 0) and s, "the server to stop")
    assert not stopped["busy"] and stopped["last"]["tokens"] < LONG // 2
    assert status_of(served)["steps"] == stopped["steps"]
    WebDriverWait(browser, WAIT_S).until(lambda d: "stopped after" in d.find_element(
        By.CSS_SELECTOR, ".message.assistant .figures").text)
    browser.find_element(By.ID, "new-chat").click()
    assert messages(browser) == [] and not browser.find_elements(By.CSS_SELECTOR, ".message")


HOSTILE = ['Here: <img src=x onerror="window.pwned=1"> and <script>window.pwned=2</script>',
           ' [a link](javascript:window.pwned=3) <svg onload="window.pwned=4"></svg>',
           '<iframe src="data:text/html,hi"></iframe><b class="src-ngram">b</b>\n\n',
           '```html\n<img src=x onerror=window.pwned=5>\n```\n']


def hostile(family, prompt, **params):
    """A stream_generate whose model output is hostile HTML."""
    for i, text in enumerate(HOSTILE):
        yield Response(text=text, tokens=[i], prompt_tokens=1, generation_tokens=i + 1, steps=i,
                       prompt_tps=1.0, generation_tps=1.0,
                       finish_reason="stop" if i + 1 == len(HOSTILE) else None,
                       provenance=[(text, "ngram")])


def test_hostile_model_output_is_rendered_inert(browser, monkeypatch, tmp_path):
    """Model output with <img onerror>, <script>, a javascript: link, <svg onload> and an
    iframe renders as inert text: no script runs, no such element exists in the message, the
    code block shows the markup as text. The page also asks for a missing API key and then
    sends it as a bearer token."""
    monkeypatch.setattr(server_mod, "stream_generate", hostile)
    family = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None), strong=None,
                             mtp=None)
    with running(family, api_key="k", max_batch=1) as srv:   # the stub decodes alone
        browser.get(f"http://127.0.0.1:{srv.server_port}/")
        WebDriverWait(browser, WAIT_S).until(
            lambda d: "API key" in d.find_element(By.ID, "notice").text)
        browser.find_element(By.ID, "api-key").send_keys("k")
        browser.execute_script("document.getElementById('api-key')"
                               ".dispatchEvent(new Event('change'))")
        WebDriverWait(browser, WAIT_S).until(
            lambda d: d.find_element(By.ID, "model").text == "model tg-tiny")
        ask(browser, "say something nasty", "ngram", 16)
        assert "(stop, ngram)" in answered(browser, 0)      # the choice outlived the key
        content = browser.find_element(By.CSS_SELECTOR, ".message.assistant .content")
        for tag in ("img", "script", "svg", "iframe", "b"):
            assert not content.find_elements(By.TAG_NAME, tag), tag
        assert browser.execute_script("return window.pwned") is None
        assert [a.get_attribute("href") for a in content.find_elements(By.TAG_NAME, "a")] == [None]
        assert "<img src=x onerror=window.pwned=5>" in content.find_element(By.TAG_NAME, "pre").text
        assert content.find_elements(By.CSS_SELECTOR, ".src-ngram")
        screenshot(browser, tmp_path, "hostile.png")
        # The second fence: markup put into the page unsanitised still runs no inline script
        # (the Content-Security-Policy); the image's error event shows the handler was due.
        browser.execute_script(
            "const d = document.createElement('div');"
            "d.innerHTML = '<img id=probe src=x onerror=\"window.pwned=6\">';"
            "d.firstChild.addEventListener('error', () => { window.probed = true; });"
            "document.body.append(d);")
        WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script("return window.probed"))
        assert browser.execute_script("return window.pwned") is None
        assert messages(browser)[1]["content"] == "".join(HOSTILE)

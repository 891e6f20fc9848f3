"""The playground at ``/`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which .ci/run installs) driven by selenium. Skipped where they are not
installed.

Against the real server (conftest.py's ``small_server``, shared with the structured-output and
tool-calling tests): a chat message streams an answer into the page over several chunks, with
its TTFT and tokens/s; a JSON schema gives a reply that is JSON of it; the dashboard's figures
move and agree with GET /metrics. Against the stub server with ``--api-key`` (it starts in
seconds, and its replies run until ``max_tokens``): the page asks for the key, says why a
wrong one failed, and then works; the stop button ends a long reply, which the server aborts
(its running count goes back to 0); Clear mid-reply leaves the aborted reply out of the next
request. The first test saves a screenshot outside the clone and prints its path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from server_utils import Server, get

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no headless browser: apt-get install chromium chromium-driver (.ci/run does)",
                allow_module_level=True)

pytest.importorskip("selenium", reason="selenium is in the test extra: pip install -e '.[test]'")
from selenium import webdriver  # noqa: E402 - after the skips, where there is a browser
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

API_KEY = "playground-key"
SCREENSHOT = os.path.join(tempfile.gettempdir(), "jaxserve-playground.png")
STUB_MAX_TOKENS = 4000
STUB_REPLY_S = STUB_MAX_TOKENS * 0.02  # how long a stub reply runs: a token per 20 ms step


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def stub_server():
    srv = Server("--max-model-len", "4096", "--api-key", API_KEY, module="stub_server",
                 startup_timeout=120)
    yield srv
    srv.stop()


def _wait(browser, condition, timeout=60.0):
    """The first truthy value of condition() (a JavaScript expression if a str), polling."""
    fn = (lambda: browser.execute_script(f"return {condition}")) if isinstance(condition, str) \
        else condition
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda _: fn())


def _text(browser, element_id) -> str:
    return browser.find_element(By.ID, element_id).text


def _summary(server) -> dict:
    status, text = get(f"{server.url}/metrics/summary")
    assert status == 200, text
    return json.loads(text)


def _open(browser, server):
    browser.get(f"{server.url}/")
    browser.get_log("browser")  # drop earlier pages' entries


def _settings(browser, **fields):
    for element_id, value in fields.items():
        box = browser.find_element(By.ID, element_id)
        box.clear()
        box.send_keys(value)


# The newest reply: its state (streaming, done, stopped, error), chunk count and readouts.
LAST_REPLY = "[...document.querySelectorAll('.message.assistant')].pop()"


def _reply(browser) -> dict:
    return browser.execute_script(f"""const m = {LAST_REPLY};
        return m && {{...m.dataset, text: m.querySelector('.content').textContent,
                     stats: m.querySelector('.stats')?.textContent}};""")


def _send(browser, text):
    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()


def _no_console_errors(browser, expected: str | None = None):
    """No script error, refused resource or CSP violation on the page, but for entries that
    contain ``expected``."""
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
              and not (expected and expected in e["message"])]
    assert not severe, severe


def test_chat_streams_and_the_dashboard_moves(browser, small_server):
    _open(browser, small_server)
    _wait(browser, "document.getElementById('model').value === 'SmolLM2-135M-Instruct'")
    _wait(browser, "document.getElementById('engine-status').textContent === 'engine ready'")
    before = int(_wait(browser, lambda: _text(browser, "m-tokens").isdigit()
                       and _text(browser, "m-tokens")))
    finished_before = int(_text(browser, "m-finished"))
    _settings(browser, **{"temperature": "0", "max-tokens": "48"})
    _send(browser, "Name three rivers in Europe and say one thing about each.")
    # Seen mid-stream: a reply with some chunks but not yet its last.
    partial = _wait(browser, lambda: (r := _reply(browser))
                    and (r["state"] != "streaming" or int(r["chunks"]) > 0) and r)
    assert partial["state"] == "streaming", f"no partial reply seen: {partial}"
    done = _wait(browser, lambda: (r := _reply(browser)) and r["state"] != "streaming" and r)
    assert done["state"] == "done", done
    assert int(done["chunks"]) > int(partial["chunks"]) and done["text"].startswith(partial["text"])
    assert float(done["ttftS"]) > 0 and float(done["tokensPerS"]) > 0
    assert "completion tokens" in done["stats"] and "TTFT" in done["stats"]
    # The dashboard polls once a second: its figures catch up with the chat.
    _wait(browser, lambda: int(_text(browser, "m-finished")) > finished_before, timeout=10)
    tokens = int(_text(browser, "m-tokens"))
    assert tokens > before
    summary, metrics = _summary(small_server), small_server.metrics()
    assert summary["generation_tokens"] == metrics["jaxserve:generation_tokens_total"] >= tokens
    for histogram in ("ttft-note", "itl-note"):
        assert "observed" in _text(browser, histogram)
    time.sleep(1.2)  # one more poll, so the tokens/s line has drawn the chat
    browser.save_screenshot(SCREENSHOT)
    print(f"screenshot of the playground: {SCREENSHOT}")
    _no_console_errors(browser)


def test_json_schema_box_gives_json_of_the_schema(browser, small_server):
    _open(browser, small_server)
    _wait(browser, "document.getElementById('model').value !== ''")
    schema = {"type": "object", "properties": {"river": {"type": "string", "maxLength": 20}},
              "required": ["river"], "additionalProperties": False}
    _settings(browser, **{"temperature": "0", "max-tokens": "40", "schema": json.dumps(schema)})
    _send(browser, "Name a river in France.")
    done = _wait(browser, lambda: (r := _reply(browser)) and r["state"] != "streaming" and r)
    assert done["state"] == "done", done
    reply = json.loads(done["text"])
    assert list(reply) == ["river"] and 0 < len(reply["river"]) <= 20
    _no_console_errors(browser)


def test_api_key_then_stop_aborts_the_request(browser, stub_server):
    _open(browser, stub_server)
    # The page met a 401 on /v1/models: it asks for the key (saying why once one was refused),
    # and then lists the model.
    _wait(browser, lambda: browser.find_element(By.ID, "key-form").is_displayed())
    assert _text(browser, "key-error") == ""
    browser.find_element(By.ID, "api-key").send_keys("wrong")
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    _wait(browser, lambda: "invalid or missing API key" in _text(browser, "key-error"))
    assert browser.find_element(By.ID, "key-form").is_displayed()
    _send(browser, "hi")
    assert _text(browser, "chat-error") == "no model yet: the server needs its API key"
    browser.find_element(By.ID, "prompt").clear()
    browser.find_element(By.ID, "api-key").clear()
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    _wait(browser, "document.getElementById('model').value === 'stub-model'")
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    finished = _summary(stub_server)["requests_finished"]
    _settings(browser, **{"max-tokens": str(STUB_MAX_TOKENS)})
    _send(browser, "Tell me a long story.")
    _wait(browser, lambda: (r := _reply(browser)) and (r["state"] != "streaming"
                                                       or int(r["chunks"]) >= 3))
    assert _reply(browser)["state"] == "streaming", _reply(browser)
    assert _summary(stub_server)["requests_running"] == 1
    stopped_at = time.monotonic()
    browser.find_element(By.ID, "stop").click()
    done = _wait(browser, lambda: (r := _reply(browser)) and r["state"] != "streaming" and r)
    assert done["state"] == "stopped" and done["text"]
    _wait(browser, lambda: _summary(stub_server)["requests_running"] == 0, timeout=10)
    # Aborted, not finished: well before the reply's end, and not counted as finished.
    assert time.monotonic() - stopped_at < STUB_REPLY_S / 4
    assert _summary(stub_server)["requests_finished"] == finished
    _no_console_errors(browser, expected="/v1/models - Failed to load resource: the server "
                       "responded with a status of 401")


def test_clear_mid_reply_starts_an_empty_conversation(browser, stub_server):
    """Clear while a reply streams: the reply is aborted and is not part of the next request."""
    _open(browser, stub_server)
    browser.execute_script(f"sessionStorage.setItem('jaxserve-api-key', '{API_KEY}')")
    _open(browser, stub_server)
    _wait(browser, "document.getElementById('model').value === 'stub-model'")
    browser.execute_script("""window.sentBodies = [];
        const fetch0 = window.fetch;
        window.fetch = (url, options) => {
          if (options?.body) window.sentBodies.push(JSON.parse(options.body));
          return fetch0(url, options);
        };""")
    _settings(browser, **{"max-tokens": str(STUB_MAX_TOKENS)})
    _send(browser, "Tell me a long story.")
    _wait(browser, lambda: (r := _reply(browser)) and int(r["chunks"]) >= 3)
    browser.find_element(By.ID, "clear").click()
    _wait(browser, lambda: _summary(stub_server)["requests_running"] == 0, timeout=10)
    _settings(browser, **{"max-tokens": "3"})
    _send(browser, "hi")
    done = _wait(browser, lambda: (r := _reply(browser)) and r["state"] != "streaming" and r)
    assert done["state"] == "done", done
    bodies = browser.execute_script("return window.sentBodies")
    assert [b["messages"] for b in bodies] == [
        [{"role": "user", "content": "Tell me a long story."}], [{"role": "user", "content": "hi"}]]
    _no_console_errors(browser)

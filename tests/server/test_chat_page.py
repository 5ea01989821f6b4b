"""The chat page at ``/`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which .ci/run installs) driven by selenium through /usr/bin/chromedriver
(selenium's own driver manager would try to download one, which fails offline). A message is
typed and sent; the streamed answer is read off the page and equals the server's own greedy
answer; a second turn resumes from the saved state; a new conversation starts empty; the stop
button ends an answer that would not end, and frees the server for the next request."""

from __future__ import annotations

import os
import shutil

import mlx_rwkvx

import pytest
from helpers import chatml_tokenizer, constant, tiny_model
from helpers.parity import CI_FLAG, import_parity_extra
from helpers.serving import serving

import_parity_extra(("fastapi", "uvicorn", "selenium"), extra="server")
openai = pytest.importorskip("openai")

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMEDRIVER) and CHROMIUM):
        missing = "Debian's chromium and chromium-driver are not installed"
        if os.environ.get(CI_FLAG) == "1":
            pytest.fail(f"{CI_FLAG}=1 but {missing}: .ci/run installs them", pytrace=False)
        pytest.skip(f"{missing}: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(driver, condition, timeout=60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def test_a_conversation_in_the_browser(browser, tmp_path):
    from selenium.webdriver.common.by import By

    tok = chatml_tokenizer(tmp_path / "tok")
    path = str(tmp_path / "m")
    mlx_rwkvx.save(tiny_model("rwkv-x", seed=41, vocab_size=512), path, tokenizer=tok)
    with serving("--model", path, "--api-key", "sesame", "--temp", "0") as server:
        c = openai.OpenAI(base_url=server.url, api_key="sesame", max_retries=0)
        browser.get(server.url.removesuffix("/v1") + "/")
        assert browser.title == "mlx_rwkvx chat"
        key = browser.find_element(By.ID, "key")
        key.send_keys("sesame")
        browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        assert browser.find_element(By.ID, "model").get_attribute("value") == path
        browser.find_element(By.ID, "temperature").clear()
        browser.find_element(By.ID, "temperature").send_keys("0")

        def say(text):
            before = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
            box = browser.find_element(By.ID, "input")
            box.send_keys(text)
            browser.find_element(By.ID, "send").click()
            _wait(
                browser,
                lambda d: (
                    len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]")) > before
                ),
            )
            return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]

        first = say("Hello, world!")
        messages = [{"role": "user", "content": "Hello, world!"}]
        want = c.chat.completions.create(
            model=path, messages=messages, max_tokens=512, temperature=0
        )
        # what the page shows is the text it was sent (the DOM keeps it as it came)
        assert first.get_property("textContent") == want.choices[0].message.content
        assert (
            "resumed from the saved state" in browser.find_element(By.CSS_SELECTOR, ".stats").text
        )
        second = say("The fox?")
        assert second.get_property("textContent")
        stats = browser.find_elements(By.CSS_SELECTOR, ".stats")[-1].text
        assert "(0 resumed" not in stats  # the second turn resumed from the first's state
        assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")

        # a new conversation starts empty; the first stays in the list
        browser.find_element(By.ID, "new").click()
        assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
        assert len(browser.find_elements(By.CSS_SELECTOR, "button.conv")) == 2


def test_the_stop_button_ends_an_answer(browser, tmp_path):
    from selenium.webdriver.common.by import By

    tok = chatml_tokenizer(tmp_path / "tok")
    path = str(tmp_path / "a")  # says "a" for ever: only the stop button ends its answer
    mlx_rwkvx.save(
        constant(tiny_model("rwkv7", seed=42, vocab_size=512), tok.encode("a")[0]),
        path,
        tokenizer=tok,
    )
    with serving(
        "--model", path, "--max-tokens", "1000000", "--max-request-tokens", "1000000"
    ) as server:
        browser.get(server.url.removesuffix("/v1") + "/")
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        browser.find_element(By.ID, "new").click()
        browser.find_element(By.ID, "input").send_keys("Go on")
        browser.find_element(By.ID, "send").click()
        answer = _wait(
            browser,
            lambda d: [
                m for m in d.find_elements(By.CSS_SELECTOR, ".msg.assistant") if len(m.text) >= 20
            ],
        )[0]
        browser.find_element(By.ID, "stop").click()
        _wait(browser, lambda d: answer.get_attribute("data-done"), timeout=10)
        assert browser.find_element(By.ID, "stop").get_property("disabled")
        length = len(answer.text)
        assert set(answer.text) == {"a"} and length >= 20
        # the server freed the slot: another request is answered at once
        c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=20)
        r = c.chat.completions.create(
            model=path, messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        assert r.choices[0].message.content == "aaa"
        assert len(answer.text) == length  # it stopped growing

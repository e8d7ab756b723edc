"""The web console in a real headless browser (Debian's chromium through selenium), against the shared stack.

A tenant logs in with its API key, watches its run's loss curve grow while the test trains the run through the
official tinker SDK, opens a checkpoint; another tenant, logged in, finds neither. The key appears in no URL and
the login cookie is out of the page's script's reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import tinker
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

import lathe
from examples import console_shot
from lathe.stack import Stack
from tests.helpers import next_token_datum, rl_datum

BASE = "lathe/tiny-llama"
KEY, OTHER = "tml-console", "tml-console-other"
WAIT_S = 60  # the most a page is waited for (a bound on a loop, not a speed asserted)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    with console_shot.chromium() as driver:
        yield driver


def log_in(browser: webdriver.Chrome, stack: Stack, key: str) -> None:
    """Log out, find the console sending to its login form, and log in with ``key``."""
    browser.get(stack.http_url + "/console/logout")
    browser.get(stack.http_url + "/console")
    assert browser.current_url.endswith("/console/login")
    console_shot.log_in(browser, stack.http_url, key)


def points(browser: webdriver.Chrome) -> int:
    """How many points the run page's loss chart draws (0 before it is drawn)."""
    charts = browser.find_elements(By.ID, "chart-forward-backward-loss-sum")
    return int(charts[0].get_attribute("data-points") or 0) if charts else 0


def step(training: tinker.TrainingClient) -> None:
    data = [next_token_datum(range(i, i + 12), tinker.types) for i in (3, 30)]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()


def test_a_tenant_watches_its_run_train_and_opens_a_checkpoint_and_another_sees_none_of_it(
        stack: Stack, browser: webdriver.Chrome, tmp_path: Path) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key=KEY)
    training = sc.create_lora_training_client(BASE, rank=4, seed=2).result()
    step(training)

    log_in(browser, stack, KEY)
    assert KEY not in browser.current_url
    cookie = browser.get_cookie("lathe_console")
    assert cookie is not None and cookie["httpOnly"] and KEY not in cookie["value"]
    assert browser.execute_script("return document.cookie") == ""
    browser.find_element(By.LINK_TEXT, training.model_id).click()
    WebDriverWait(browser, WAIT_S).until(lambda b: points(b) == 1)

    step(training)
    step(training)  # the open page adds the new points by itself
    WebDriverWait(browser, WAIT_S).until(lambda b: points(b) == 3)
    titles = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".chart h3")]
    assert "forward_backward loss:sum" in titles and "optim_step grad_norm:mean" in titles
    browser.save_screenshot(str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 1000

    path = training.save_weights_for_sampler("console").result().path
    browser.refresh()
    browser.find_element(By.LINK_TEXT, path).click()
    WebDriverWait(browser, WAIT_S).until(lambda b: b.title.startswith("Checkpoint sampler_weights/console"))
    body = browser.find_element(By.TAG_NAME, "main").text
    assert path in body and "private" in body and training.model_id in body
    checkpoint_url, run_url = browser.current_url, stack.http_url + f"/console/training_runs/{training.model_id}"

    log_in(browser, stack, OTHER)
    assert training.model_id not in browser.find_element(By.TAG_NAME, "main").text
    for url, said in ((run_url, "unknown model_id"), (checkpoint_url, "")):
        browser.get(url)
        assert browser.title.startswith("Not available"), url
        assert said in browser.find_element(By.TAG_NAME, "main").text
    assert httpx.get(run_url + "/points", cookies={"lathe_console": browser.get_cookie("lathe_console")["value"]}
                     ).status_code == 404


def test_a_bad_key_or_a_forged_cookie_gets_the_login_form(stack: Stack) -> None:
    with httpx.Client(base_url=stack.http_url) as http:
        refused = http.post("/console/login", data={"api_key": "not-a-tinker-key"})
        assert refused.status_code == 401 and "must start with" in refused.text and "set-cookie" not in refused.headers
        forged = http.get("/console/", cookies={"lathe_console": "e30.AAAA"}, follow_redirects=False)
        assert forged.status_code == 303 and forged.headers["location"] == "/console/login"
        ok = http.post("/console/login", data={"api_key": KEY}, follow_redirects=False)
        assert ok.status_code == 303 and "httponly" in ok.headers["set-cookie"].lower()
        assert "samesite=strict" in ok.headers["set-cookie"].lower()


def test_lathes_sdk_links_a_session_a_run_and_a_save_to_their_console_pages(stack: Stack) -> None:
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key=KEY)
    training = lc.create_lora_training_client(BASE, rank=4, seed=5)
    saved = training.save_weights_for_sampler("linked").result()
    url = saved.get_console_url()
    assert url.startswith(stack.http_url + "/console/checkpoints/")
    with httpx.Client() as http:
        http.post(stack.http_url + "/console/login", data={"api_key": KEY})
        page = http.get(url)
    assert page.status_code == 200 and saved.path in page.text
    run_page = training.get_console_url()
    assert run_page == f"{stack.http_url}/console/training_runs/{quote(training.model_id, safe='')}"
    session_page = lc.get_console_url()
    assert session_page.startswith(stack.http_url + "/console/sessions/sess-")
    with httpx.Client() as http:
        http.post(stack.http_url + "/console/login", data={"api_key": KEY})
        assert training.model_id in http.get(run_page).text
        assert training.model_id in http.get(session_page).text


def test_an_rl_runs_points_carry_its_sampler_trainer_kl(stack: Stack) -> None:
    """An importance_sampling step on the very policy that sampled reports ``sampler_kl:mean`` 0.0 (the pools'
    bits agree), and the run page's points carry it for the console's KL curve."""
    with lathe.ServiceClient(base_url=stack.gateway, api_key=KEY) as lc:
        training = lc.create_lora_training_client(BASE, rank=4, seed=6)
        prompt = [4, 9, 16, 25]
        res = training.save_weights_and_get_sampling_client("rl").sample(
            lathe.ModelInput.from_ints(prompt), 2, lathe.SamplingParams(max_tokens=5, seed=3, stop=[])).result()
        data = [rl_datum(prompt, s.tokens, s.logprobs, 1.0) for s in res.sequences]
        fb = training.forward_backward(data, "importance_sampling").result()
    assert fb.metrics["sampler_kl:mean"] == 0.0
    with httpx.Client(base_url=stack.http_url) as http:
        http.post("/console/login", data={"api_key": KEY})
        got = http.get(f"/console/training_runs/{quote(training.model_id, safe='')}/points").json()
    assert [p["metrics"]["sampler_kl:mean"] for p in got if p["op"] == "forward_backward"] == [0.0]

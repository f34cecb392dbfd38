"""The submit form shows what a recipe's `model` can name (issue 17 §3), in headless Chromium
against a real `tuner serve` (the API only) with the test plugin installed: the families, the hf
model types, each installed plugin with its package and option schema, and a plugin recipe
started from the list that is refused with the option's field error, then queued once fixed.
Screenshots land in test-artifacts/screenshots/."""

from __future__ import annotations

import json

import httpx
import pytest
from chromium import NEEDS_CHROMIUM
from plugin_env import install_test_plugin
from test_api_server import Server
from test_browser_dashboard import _shot

pytestmark = [pytest.mark.slow, NEEDS_CHROMIUM]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    install_test_plugin()  # before the server starts: it lists what its environment has
    server = Server(tmp_path_factory.mktemp("models-form"), None, workers=0)
    token = server.tuner("token", "create", "--name", "browser")
    server.start()
    try:
        yield {"base": server.base, "token": token}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def page(server, browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.add_init_script(f"localStorage.setItem('tuner.token', {json.dumps(server['token'])})")
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(f"{server['base']}/ui/jobs")
    # The server's first listing imports transformers: seconds on a loaded machine.
    pg.wait_for_selector("#models[data-loaded=true]", timeout=120_000)
    yield pg
    ctx.close()
    assert not errors, errors


def test_the_form_lists_the_families_the_hf_types_and_each_plugins_options(page):
    rows = page.locator("#families-table tbody tr")
    assert [r.get_attribute("data-family") for r in rows.all()] == ["gpt", "hf", "llama", "plugin"]
    hf = page.locator("#families-table tr[data-family=hf]")
    hf.locator("summary").click()
    assert all(t in hf.inner_text() for t in ("qwen2", "mistral", "llama", "model.config"))
    card = page.locator("#plugins [data-plugin=tiny-moe]")
    assert "package tuner-test-plugin 0.1.0" in card.inner_text()
    assert "soft-gated expert MLPs" in card.inner_text()
    experts = card.locator("tr[data-option=experts]").inner_text().split("\t")
    assert experts == ["model.options.experts", "integer", "4", "1 to 64", "Expert MLPs per block."]
    _shot(page, "submit-form-models")


def test_a_plugin_recipe_started_from_the_list_is_checked_then_queued(server, page):
    page.click("button.start-from[data-model=tiny-moe]")
    text = page.input_value("#recipe-text")
    assert 'model: {family: "plugin", plugin: "tiny-moe", seq_len: 64, options: {' in text
    assert "experts: 4" in text and "hardware: {device: cpu, devices: 1}" in text  # the form's defaults
    # A bad option is the plugin schema's field error, next to the line that holds it.
    page.fill("#recipe-text", text.replace("experts: 4", "experts: 0"))
    page.click("#recipe-submit")
    error = page.locator("#recipe-errors li[data-field='model.options.experts']")
    error.wait_for()
    assert "greater than or equal to 1" in error.inner_text() and "(line 3)" in error.inner_text()
    page.fill("#recipe-text", text)
    page.click("#recipe-submit")
    link = page.locator("#new-job-link")
    link.wait_for()
    job = httpx.get(
        f"{server['base']}/v1/jobs/{link.get_attribute('href').rsplit('/', 1)[1]}",
        headers={"Authorization": f"Bearer {server['token']}"},
    ).json()
    assert job["state"] == "queued" and job["recipe"]["model"]["plugin"] == "tiny-moe"
    assert job["recipe"]["model"]["options"]["experts"] == 4

"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright): the page is opened before the
job exists; a crash drill then runs, and its loss curve and the crash incident appear on the page without a reload,
pushed by the server; a hostile string stays text; a broker outage shows as a banner and goes when the broker is back.
Then the page acts: read-only until the operator token is given, it pauses, resumes and cancels a running job, and
shows the refusal of a pause of a paused job in the client's words.
The browser comes from `make test`'s install step (`apt-get install chromium`)."""

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Page, async_playwright

from flightdeck.events import subjects
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import CancelRequested
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.web.server import serve
from tests.e2e.drill_harness import crash_spec, drill_spec, paced
from tests.integration.lifecycle_harness import Platform

pytestmark = [pytest.mark.slow]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parents[2]
WAIT_MS = 150_000
TOKEN = "an-operator-token-for-the-test"


@pytest.fixture
async def ui(drill: Platform) -> AsyncIterator[str]:
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(drill.url, "127.0.0.1", 0, stop, ready=ready, token=TOKEN))
    try:
        yield f"http://127.0.0.1:{await asyncio.wait_for(ready, 60)}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@pytest.fixture
async def page() -> AsyncIterator[Page]:
    assert CHROMIUM, "no chromium on PATH: `make test` installs it (apt-get install chromium)"
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield await browser.new_page(viewport={"width": 1280, "height": 1600})
        finally:
            await browser.close()


@pytest.mark.timeout(420)
async def test_a_running_jobs_curve_and_crash_incident_appear_without_a_reload(
        drill: Platform, ui: str, page: Page, nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    p, job = drill, "crash-000001"
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    await page.goto(f"{ui}/?job={job}")
    await page.wait_for_function("document.getElementById('job-title').textContent.includes('no such job yet')")
    await page.evaluate("window.loadedOnce = true")  # a reload would lose it

    await p.submit(crash_spec(), job)
    await page.wait_for_function("Number(document.getElementById('loss').dataset.points) >= 10", timeout=WAIT_MS)
    assert await page.locator("#loss").get_attribute("data-scale") == "log"  # a x10 spike keeps the curve readable
    crash = page.locator('#incidents tr[data-kind="crash"]')
    await crash.wait_for(timeout=WAIT_MS)
    assert "exited with code 3" in await crash.inner_text()
    # its evidence, folded under its trigger: the causal chain, event by event
    assert "WorkersExited: rank 1 (attempt 0)" in (await crash.locator("ol.evidence").text_content() or "")
    await page.wait_for_function(f"""document.querySelector('#jobs tr[data-job="{job}"]')
                                     ?.textContent.includes('completed')""", timeout=WAIT_MS)
    assert await page.evaluate("window.loadedOnce") is True
    assert await page.locator('#checkpoints tr[data-state="kept"]').count() >= 1
    assert await page.locator('#fleet tr[data-node="n1"]').inner_text() != ""
    await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

    # A hostile string in the event log (a request's reason: anyone with the CLI writes one) is shown as text, never
    # run as markup.
    hostile = "<img src=x onerror=window.pwned=1>"
    store = await JetStreamStore.connect(p.url)
    try:
        await append_to_job(store, CancelRequested(job_id=job, event_id="evil-1", occurred_at=time.time(),
                                                   producer="cli", reason=hostile))
        # a metric of the script's own (report(step, loss, acc=...)) gets a chart of its own, by its name
        await store.append(subjects.telemetry(job, 0, "StepCompleted"), StepCompleted(
            job_id=job, rank=0, attempt=1, node="n1", step=99, loss=1.0, grad_norm=0.0, lr=0.0, tokens_per_s=0.0,
            step_time_s=0.1, metrics={"val/acc": 0.5}, event_id="own-metric-1", occurred_at=time.time()))
    finally:
        await store.close()
    await page.wait_for_function("""Number(document.querySelector('figure[data-metric="val/acc"] div[data-points]')
                                        ?.dataset.points) >= 1""", timeout=WAIT_MS)
    await page.wait_for_function(f"document.getElementById('decisions').textContent.includes({hostile!r})",
                                 timeout=WAIT_MS)
    assert await page.evaluate("window.pwned === undefined")
    assert await page.locator("#decisions img").count() == 0

    # The broker goes away: the page says so; it comes back: the banner goes, by itself.
    nats_server.stop()
    await page.locator("#outage").wait_for(state="visible", timeout=WAIT_MS)
    back = await asyncio.to_thread(nats_server.restart)
    nats_server.proc = back.proc  # the fixture stops this one at the end
    await page.locator("#outage").wait_for(state="hidden", timeout=WAIT_MS)
    assert await page.evaluate("window.loadedOnce") is True

    # Acting from the page on a long job: nothing until the operator token is given, then the client's calls.
    acted = "acted-000001"
    await p.submit(drill_spec("acted", steps=100_000, faults=[paced()]), acted)
    await page.goto(f"{ui}/?job={acted}")
    title = "document.getElementById('job-title').textContent"
    await page.wait_for_function(f"{title}.endsWith('running')", timeout=WAIT_MS)
    # its layout as the resharder recorded it, each rank's place in the mesh beside its node
    await page.wait_for_function("document.getElementById('plan').textContent.startsWith("
                                 "'planned: TP 1 x PP 1 x DP 2 on 2 ranks')", timeout=WAIT_MS)
    placed = await page.locator('#layout tr[data-rank="1"] td').all_inner_texts()
    assert placed[:2] == ["1", "n1"] and placed[3:] == ["0", "1", "0"], placed  # pp 0, dp 1, tp 0
    button = {a: page.locator(f'#actions button[data-action="{a}"]') for a in ("pause", "resume", "cancel")}
    assert await button["pause"].is_disabled() and "read-only" in await page.locator("#mode").inner_text()
    await page.fill("#token", TOKEN)
    await page.click("#token-form button")
    result = "document.getElementById('action-result').textContent"
    await button["pause"].click()
    await page.wait_for_function(f"{result}.startsWith('pause: PauseRequested sent')", timeout=WAIT_MS)
    await page.wait_for_function(f"{title}.endsWith('paused')", timeout=WAIT_MS)
    await button["pause"].click()
    await page.wait_for_function(f"{result}.includes('refused')", timeout=WAIT_MS)
    assert f"{acted} is paused already" in await page.locator("#action-result").inner_text()
    await button["resume"].click()
    await page.wait_for_function(f"{title}.endsWith('running')", timeout=WAIT_MS)
    await page.screenshot(path=str(tmp_path / "dashboard-job.png"), full_page=True)
    await button["cancel"].click()
    await page.wait_for_function(f"{title}.endsWith('cancelled')", timeout=WAIT_MS)
    assert await button["pause"].is_disabled()  # an ended job takes no action

    # The job list filters by name and phase; two ticked runs are compared, their loss curves overlaid.
    await page.fill("#name-filter", "crash")
    await page.wait_for_function("document.querySelectorAll('#jobs tbody tr').length === 1")
    assert await page.locator("#jobs tbody tr").get_attribute("data-job") == job
    await page.fill("#name-filter", "")
    await page.select_option("#phase-filter", "cancelled")
    await page.wait_for_function("document.querySelectorAll('#jobs tbody tr').length === 1")
    assert await page.locator("#jobs tbody tr").get_attribute("data-job") == acted
    await page.select_option("#phase-filter", "")
    for name in (acted, job):
        await page.locator(f'#jobs tr[data-job="{name}"] input[type=checkbox]').check()
    await page.click("#compare-link")
    await page.wait_for_function("Number(document.getElementById('compare-loss')?.dataset.points) >= 10",
                                 timeout=WAIT_MS)
    assert "crash-000001" in await page.locator('figure[data-compare="loss"] figcaption').inner_text()

"""What a `curl /metrics` shows of one job: the demo prints it so a new user sees the Prometheus figures agree with
the timeline and `status` above them. The exposition is parsed with prometheus-client's own parser."""

import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from flightdeck.services.tools.history.jobview import ENDED

# The figures a person checks first; the histograms' buckets would drown them.
SHOWN = ("flightdeck_job_phase", "flightdeck_job_step", "flightdeck_job_restarts_total",
         "flightdeck_job_rollbacks_total", "flightdeck_job_incidents_total", "flightdeck_job_goodput_ratio",
         "flightdeck_checkpoint_commit_seconds_count")


def job_lines(exposition: str, job_id: str) -> list[str]:
    """The SHOWN samples labelled with `job_id`, one `name{labels} value` line each (a phase only where it is 1)."""
    lines = []
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name not in SHOWN or s.labels.get("job_id") != job_id:
                continue
            if s.name == "flightdeck_job_phase" and s.value != 1.0:
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            lines.append(f"{s.name}{{{labels}}} {s.value:g}")
    return lines


def settled(lines: list[str], commits: int | None = None) -> bool:
    """The server has folded the job's end and postmortem's analysis of it (goodput comes from that analysis), and
    `commits` checkpoint commits if given (a completed job's final one may be committed after its end)."""
    ended = any(line.startswith("flightdeck_job_phase{") and f'phase="{p}"' in line for line in lines for p in ENDED)
    counted = commits is None or any(line.startswith("flightdeck_checkpoint_commit_seconds_count{")
                                     and float(line.rsplit(" ", 1)[-1]) == commits for line in lines)
    return ended and counted and any(line.startswith("flightdeck_job_goodput_ratio{") for line in lines)


def scrape(url: str, job_id: str, wait_s: float, commits: int | None = None) -> tuple[list[str], str]:
    """The job's lines from `url`, waiting up to `wait_s` for the server to fold the job's end (and `commits`
    checkpoint commits, when given: the caller has read that many from the log); and why none, if so. The wait is
    a bound on a live server catching up with a log it follows, not a measure of anything."""
    deadline, lines, why = time.monotonic() + wait_s, [], ""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                lines, why = job_lines(resp.read().decode(), job_id), ""
        except (urllib.error.URLError, OSError) as exc:
            why = f"{url}: {exc}"
        if (lines and settled(lines, commits)) or time.monotonic() > deadline:
            return lines, why
        time.sleep(0.5)

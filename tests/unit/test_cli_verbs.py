"""The `flightdeck` command line imports only the verb it runs: every verb is registered under its own name, a
command's start does not load the dashboard, the node agent or the plotting, and `--help` still lists every verb."""

import subprocess
import sys

import pytest

from flightdeck.services.tools.console.__main__ import VERBS, command, main, parser
from flightdeck.services.tools.console.jobs_cmd import SORTS, chosen
from flightdeck.services.tools.history.jobview import JobView
from tests.integration.test_lifecycle_services import ROOT

HEAVY = ("matplotlib", "numpy", "flightdeck.services.tools.web", "flightdeck.services.agent.main",
         "flightdeck.services.tools.postmortem")


def test_every_verb_is_registered_under_its_commands_own_name() -> None:
    assert [command(verb).name for verb in VERBS] == list(VERBS)


@pytest.mark.parametrize("verb", ["status", "submit", "pause", "events", "logs", "verify"])
def test_a_command_imports_its_own_verb_and_nothing_heavy(verb: str) -> None:
    probe = ("import sys\nfrom flightdeck.services.tools.console.__main__ import parser\n"
             f"parser({verb!r})\nprint(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_help_lists_every_verb_and_an_unknown_one_is_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(VERBS) <= set(parser().format_help().replace(",", " ").replace("{", " ").replace("}", " ").split())
    with pytest.raises(SystemExit) as exc:
        parser("nonsense").parse_args(["nonsense"])
    assert exc.value.code == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err


# Verbs whose output is not a result a script reads: a process that serves (up, agent, ui), a live display
# (watch), a history file (export writes .fdh itself) or a script for a shell (completion).
NO_RESULT = {"up", "down", "agent", "ui", "watch", "export", "completion"}


@pytest.mark.parametrize("verb", sorted(set(VERBS) - NO_RESULT))
def test_every_verb_that_prints_a_result_has_json(verb: str) -> None:
    options = {o for a in parser(verb)._subparsers._group_actions[0].choices[verb]._actions  # type: ignore[union-attr]
               for o in a.option_strings}
    assert "--json" in options, verb


def test_version_names_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"flightdeck {version('flightdeck')}\n"
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"flightdeck {version('flightdeck')}\n"


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_covers_every_verb_and_its_options(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    for verb in VERBS:
        assert verb in script, verb
    assert "--to-step" in script and "--phase" in script  # a verb's own options, not only the verbs


def test_jobs_filters_by_phase_groups_and_name_and_sorts() -> None:
    views = [JobView(job_id=f"{name}-{i}", name=name, phase=phase, submitted_at=float(i), priority=p)
             for i, (name, phase, p) in enumerate([("llama", "running", 1), ("gpt", "completed", 5),
                                                    ("llama", "failed", 3), ("gpt", "paused", 2)])]
    ids = lambda vs: [v.job_id for v in vs]  # noqa: E731
    assert ids(chosen(views, ["live"], None)) == ["llama-0", "gpt-3"]
    assert ids(chosen(views, ["ended"], "llama")) == ["llama-2"]
    assert ids(chosen(views, ["running", "paused"], None)) == ["llama-0", "gpt-3"]
    assert ids(chosen(views, None, "gpt")) == ["gpt-1", "gpt-3"]
    assert ids(sorted(views, key=SORTS["submitted"])) == ["gpt-3", "llama-2", "gpt-1", "llama-0"]
    assert ids(sorted(views, key=SORTS["priority"])) == ["gpt-1", "llama-2", "gpt-3", "llama-0"]


def test_one_option_has_one_placeholder_in_every_verb() -> None:
    """`--nats URL` everywhere (down once said NATS), `--data-dir DIR`, a job is JOB whether positional or not."""
    seen: dict[str, set[str]] = {}
    for verb in VERBS:
        sub = parser(verb)._subparsers._group_actions[0].choices[verb]  # type: ignore[union-attr]
        for action in sub._actions:
            if action.nargs == 0 or not (action.option_strings or action.dest == "job"):
                continue
            name = action.option_strings[0] if action.option_strings else "job"
            seen.setdefault(name, set()).add(str(action.metavar or action.dest.upper()))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {"--out": {"DIR", "FILE"}}  # a folder, or a file
    assert seen["job"] == seen["--resume-from"] == {"JOB"} and seen["--nats"] == {"URL"}
    assert seen["--data-dir"] == {"DIR"}

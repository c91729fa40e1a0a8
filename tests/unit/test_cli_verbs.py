"""The `flightdeck` command line imports only the verb it runs: every verb is registered under its own name, a
command's start does not load the dashboard, the node agent or the plotting, and `--help` still lists every verb."""

import subprocess
import sys

import pytest

from flightdeck.services.tools.console.__main__ import VERBS, command, parser
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

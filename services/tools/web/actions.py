"""The dashboard's operator actions: `POST /api/jobs/<job>/<action>` with the operator token as a bearer token and
a JSON body, answered with JSON. Each action is the Python client's call (cancel, pause, resume, checkpoint,
rollback), so it is refused exactly as `flightdeck <verb>` refuses it (a paused job's pause, an ended job's
command), with the client's one line. Without a token the server takes none: the page stays read-only.

The token travels in a header, never a cookie, so another site's form cannot make a logged-in browser act."""

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from flightdeck.services.tools.cli import EXIT_NOT_FOUND
from flightdeck.services.tools.client import Client, ClientError

log = structlog.get_logger("flightdeck.web")
MAX_BODY = 4096  # an action's body: a reason and a few numbers
REASON_MAX = 300


class BadRequest(ValueError):
    """An action's body the page should not have sent: answered 400 with the reason."""


def _int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit():
        raise BadRequest(f"{key} must be a whole number of 0 or more, not {value!r}")
    return int(value)


async def _rollback(fd: Client, job: str, reason: str, body: dict[str, Any]) -> str:
    to_step = _int(body, "to_step")
    if to_step is None:
        raise BadRequest("a rollback needs to_step: the newest checkpoint at or before it is restored")
    skip_from, skip_to = _int(body, "skip_from"), _int(body, "skip_to")
    if (skip_from is None) != (skip_to is None) or (skip_from is not None and skip_to is not None
                                                    and skip_from >= skip_to):
        raise BadRequest("a skip window is skip_from < skip_to, both given (or neither)")
    skip = (skip_from, skip_to) if skip_from is not None and skip_to is not None else None
    target = await fd.rollback(job, to_step, skip=skip, reason=reason)
    return f"rollback to {target} asked; the scheduler decides it and the ranks report RolledBack"


async def _cancel(fd: Client, job: str, reason: str, body: dict[str, Any]) -> str:
    view = await fd.cancel(job, reason)
    if view.ended:
        raise ClientError(f"{job} has already ended ({view.phase}): nothing to cancel")
    if view.cancel_requested:
        return f"a cancel was already requested (phase {view.phase})"
    return f"cancel requested (phase {view.phase})"


def _command(call: Callable[[Client, str, str], Awaitable[None]], event: str) -> Callable[..., Awaitable[str]]:
    async def act(fd: Client, job: str, reason: str, body: dict[str, Any]) -> str:
        await call(fd, job, reason)
        return f"{event} sent; its ranks obey it at their next step boundary"
    return act


ACTIONS: dict[str, Callable[[Client, str, str, dict[str, Any]], Awaitable[str]]] = {
    "cancel": _cancel, "pause": _command(Client.pause, "PauseRequested"),
    "resume": _command(Client.resume, "ResumeRequested"),
    "checkpoint": _command(Client.checkpoint, "CheckpointRequested"), "rollback": _rollback,
}
STATUS = {EXIT_NOT_FOUND: 404}  # no such job; a refusal otherwise is 409: the job is not in a phase that takes it


class Actions:
    def __init__(self, client: Client, token: str | None) -> None:
        self.client, self.token = client, token

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    async def handle(self, request: web.Request) -> web.Response:
        if not self.token:
            return _answer(403, error="this server takes no actions: it was started without an operator token "
                                      "(`flightdeck ui --operator-token-file FILE`)")
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return _answer(401, error="the operator token is missing or wrong")
        job, action = request.match_info["job"], request.match_info["action"]
        act = ACTIONS.get(action)
        if act is None:
            return _answer(404, error=f"no action {action!r}: one of {', '.join(ACTIONS)}")
        try:
            raw = await request.content.read(MAX_BODY + 1)
            body = json.loads(raw or b"{}") if len(raw) <= MAX_BODY else None
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return _answer(400, error=f"the body must be a JSON object of at most {MAX_BODY} bytes")
        reason = str(body.get("reason") or f"{action} from the dashboard")[:REASON_MAX]
        try:
            said = await act(self.client, job, reason, body)
        except BadRequest as exc:
            return _answer(400, error=str(exc))
        except ClientError as exc:
            return _answer(STATUS.get(exc.code, 409), error=str(exc))
        log.info("web.action", job=job, action=action, said=said)
        return _answer(200, job=job, action=action, said=said)


def _answer(status: int, **body: str) -> web.Response:
    return web.json_response(body, status=status)

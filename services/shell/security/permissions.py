"""Who may publish and subscribe to what on the broker: one NATS user per service and per node agent, plus the
operator's `console` and `admin`, each with subject permissions derived from the subject grammar
(events/subjects.py) and from the event types each producer is the author of.

The config the broker loads (render.py) and the tests read the same `Permissions` values, so they cannot
drift. A service may publish only the decisions it authors, its own clock and dead letters, and the
JetStream API calls its shell makes (its own durable consumer, ephemeral read consumers, direct gets).
A job's ranks have no user at all: their node agent is their only link (events/ranklink.py).
"""

from dataclasses import dataclass

from flightdeck.events import subjects
from flightdeck.events.authors import FLEET_TELEMETRY, JOB_TYPES, NODE_TYPES, TELEMETRY_TYPES
from flightdeck.events.subjects import CONTROL

# the scheduler's alone; a command it shares with a person (a pause) is not a decision only it may publish
SCHEDULER_DECISIONS = tuple(t for t in JOB_TYPES["scheduler"]
                            if not any(t in types for role, types in JOB_TYPES.items() if role != "scheduler"))

ADMIN, CONSOLE, AGENT = "admin", "console", "agent"
JS = "$JS.API"


def durable(service: str) -> str:
    """The durable consumer a service's shell reads FD_CONTROL through (services/runtime.consumer_name)."""
    return f"service-{subjects.token(service)}"


def inbox(user: str) -> str:
    """The reply-subject prefix a user's connection uses; no other user may subscribe under it."""
    return f"_INBOX.{subjects.token(user)}"


def agent_user(node: str | None) -> str:
    """`agent-<node>` may act only for its node; the plain `agent` for any node (one secret per fleet)."""
    return f"{AGENT}-{subjects.token(node)}" if node else AGENT


@dataclass(frozen=True)
class Permissions:
    """A NATS user's permissions: publish and subscribe allow/deny lists of subject patterns. An empty
    allow list with `everything` False means nothing is allowed."""

    user: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    everything: bool = False  # admin: no permissions block at all
    responses: bool = False  # may answer the requests it receives (allow_responses), whatever their reply subject

    def may_publish(self, subject: str) -> bool:
        return self.everything or _allowed(subject, self.publish, self.publish_deny)

    def may_subscribe(self, subject: str) -> bool:
        return self.everything or _allowed(subject, self.subscribe, self.subscribe_deny)


def _allowed(subject: str, allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    return any(subjects.matches(p, subject) for p in allow) and not any(subjects.matches(p, subject) for p in deny)


def _reader_api(user: str) -> list[str]:
    """The JetStream API a process that reads the streams needs: stream info (startup checks the streams
    exist), ephemeral consumers (events/jsreader.Replay: `CONSUMER.CREATE.<stream>` with no name, which the
    server refuses to make durable), deleting them, their flow control, and direct gets."""
    return [f"{JS}.INFO", f"{JS}.STREAM.INFO.*", f"{JS}.CONSUMER.CREATE.*", f"{JS}.CONSUMER.INFO.*.*",
            f"{JS}.CONSUMER.DELETE.*.*", f"{JS}.DIRECT.GET.>", f"{JS}.STREAM.MSG.GET.*", "$JS.FC.>"]


def _shell_api(consumer: str) -> list[str]:
    """What services/shell/runtime.py does with its own durable: create it, pull from it, ack its messages."""
    return [f"{JS}.CONSUMER.DURABLE.CREATE.{CONTROL}.{consumer}", f"{JS}.CONSUMER.MSG.NEXT.{CONTROL}.{consumer}",
            f"$JS.ACK.{CONTROL}.{consumer}.>"]


def platform_durables(nodes: tuple[str, ...]) -> list[str]:
    """The durable consumers the services and the named nodes' agents read FD_CONTROL through."""
    return [durable(s) for s in (*subjects.SERVICES, *(agent_user(n) for n in nodes))]


def _others_durables(own: str, nodes: tuple[str, ...]) -> list[str]:
    """Deny touching another service's durable: deleting it would make that service re-decide its inputs, and
    creating it again with another filter (`CONSUMER.CREATE.<stream>.<name>[.<filter>]` updates a consumer) would
    make it skip every input outside that filter."""
    names = [name for name in platform_durables(nodes) if name != own]
    return [f"{JS}.CONSUMER.{verb}.{CONTROL}.{name}" for name in names
            for verb in ("DELETE", "DURABLE.CREATE", "MSG.NEXT", "CREATE")] + [
        f"{JS}.CONSUMER.CREATE.{CONTROL}.{name}.>" for name in names] + [
        f"$JS.ACK.{CONTROL}.{name}.>" for name in names]


def _producer(user: str, role: str, name: str, node_token: str, nodes: tuple[str, ...],
              wildcard_name: bool = False) -> Permissions:
    consumer = durable(name) if not wildcard_name else "*"
    jobs = JOB_TYPES.get(role, ())
    publish = [*(f"fd.ctl.job.*.{t}" for t in jobs if t not in subjects.NODE_RECORDS),
               *(f"fd.ctl.job.*.node.{node_token}.{t}" for t in jobs if t in subjects.NODE_RECORDS),
               *(f"fd.ctl.node.{node_token}.{t}" for t in NODE_TYPES.get(role, ())),
               *(f"fd.tel.*.*.{t}" for t in TELEMETRY_TYPES.get(role, ())),
               *(subjects.fleet_telemetry(node_token, t) if node_token != "*" else f"fd.tel.{subjects.FLEET}.*.{t}"
                 for t in FLEET_TELEMETRY.get(role, ())),
               *(["fd.log.*.*.*"] if role == AGENT else []),  # what the ranks it runs print (events/logs.py)
               subjects.clock(name) if not wildcard_name else "fd.ctl.clock.*",
               *([f"fd.state.{subjects.token(name)}.>"] if role in subjects.SERVICES else []),  # its own snapshots
               subjects.dead(name) if not wildcard_name else "fd.dead.*",
               *_reader_api(user), *_shell_api(consumer)]
    deny = _others_durables(consumer, nodes)
    if wildcard_name:  # the fleet-wide agent: any agent-<node> clock, never a service's
        deny += [*(subjects.clock(s) for s in subjects.SERVICES), *(subjects.dead(s) for s in subjects.SERVICES)]
    advisory = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{CONTROL}.{consumer}"
    return Permissions(user=user, publish=tuple(publish), subscribe=(f"{inbox(user)}.>", advisory),
                       publish_deny=tuple(deny))


def service(name: str, nodes: tuple[str, ...] = ()) -> Permissions:
    """A built-in service's user (its name is the user name)."""
    if name not in subjects.SERVICES:
        raise ValueError(f"no built-in service called {name!r}: choose one of {', '.join(subjects.SERVICES)}")
    return _producer(name, name, name, "*", nodes)


def agent(node: str | None, nodes: tuple[str, ...] = ()) -> Permissions:
    """A node agent: WorkersStarted/WorkersExited for any job (it starts whatever the grants say), the
    RankHeartbeats batches of the ranks it runs, and its node's fleet events. Without a node, the fleet-wide
    `agent` user may act for any node."""
    if node:
        return _producer(agent_user(node), AGENT, agent_user(node), subjects.token(node), nodes)
    return _producer(AGENT, AGENT, AGENT, "*", nodes, wildcard_name=True)


def console(nodes: tuple[str, ...] = ()) -> Permissions:
    """The `flightdeck` CLI an operator runs: reads everything, requests, never decides."""
    publish = [*(f"fd.ctl.job.*.{t}" for t in JOB_TYPES[CONSOLE]), *(f"fd.ctl.node.*.{t}" for t in NODE_TYPES[CONSOLE]),
               *_reader_api(CONSOLE)]
    return Permissions(user=CONSOLE, publish=tuple(publish), subscribe=(f"{inbox(CONSOLE)}.>",),
                       publish_deny=tuple(_others_durables("", nodes)))


def admin() -> Permissions:
    """Provisions the streams and imports histories: everything. Keep its secret off the fleet."""
    return Permissions(user=ADMIN, publish=(">",), subscribe=(">",), everything=True)


def fleet(nodes: tuple[str, ...] = (), *, fleet_agent: bool = True) -> list[Permissions]:
    """Every user of a deployment: admin, console, the five services and the agents."""
    users = [admin(), console(nodes), *(service(s, nodes) for s in subjects.SERVICES)]
    if fleet_agent:
        users.append(agent(None, nodes))
    users += [agent(n, nodes) for n in nodes]
    return users

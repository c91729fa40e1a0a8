"""Write the NATS users config.

Why it works this way: docs/internals.md, "9. Security and deployment".
"""

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from events.subjects import InvalidSubjectToken
from services.shell.broker import nats_url
from services.shell.logging import configure
from services.shell.security import natsjwt, permissions, render
from services.shell.security.credentials import PASSWORD_FILE, USER, client_options
from services.shell.security.gate import DEFAULT_TTL_S, Gate
from services.shell.security.passwords import DEFAULT_COST, SecretsDir, bcrypt, job_password, write_private

SHIPPED = Path(__file__).resolve().parents[3] / "infra" / "nats" / "accounts.conf"


def rendered(secrets: SecretsDir, nodes: tuple[str, ...], jobs: tuple[str, ...], *, cost: int = DEFAULT_COST,
             fleet_agent: bool = True, gate: bool = False) -> str:
    """With `gate`, jobs need no users here: the job gate (gate.py) admits their ranks through the auth callout."""
    users = [*permissions.fleet(nodes, jobs, fleet_agent=fleet_agent), *([permissions.gate()] if gate else [])]
    job_users = {permissions.job_user(j): j for j in jobs}
    key = secrets.job_key() if jobs else ""

    def password(user: str) -> str:
        return job_password(key, job_users[user]) if user in job_users else secrets.password(user)

    issuer = natsjwt.public_key(secrets.issuer_seed()) if gate else ""
    return render.render(users, render.hashed(lambda user: bcrypt(password(user), cost)), issuer=issuer)


def shipped() -> str:
    return render.render(permissions.fleet(), render.from_environment)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.shell.security", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)
    r = verbs.add_parser("render", help="a deployment's users config, with hashed passwords")
    r.add_argument("--secrets", type=Path, required=True, help="directory of password files (created if missing)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--node", action="append", default=[], help="a node with its own agent-<node> user")
    r.add_argument("--job", action="append", default=[], help="a job id to give a user")
    r.add_argument("--cost", type=int, default=DEFAULT_COST, help="bcrypt work factor (4-31)")
    r.add_argument("--no-fleet-agent", action="store_true", help="no shared `agent` user: per-node users only")
    r.add_argument("--reload", type=Path, metavar="PIDFILE", help="SIGHUP this nats-server afterwards")
    r.add_argument("--gate", action="store_true",
                   help="jobs need no user here: the job gate admits their ranks (auth callout; run `gate`)")
    g = verbs.add_parser("gate", help="run the job gate: issue each running job's ranks their broker identity")
    g.add_argument("--secrets", type=Path, required=True, help="the directory `render --gate` used (job key, issuer)")
    g.add_argument("--nats", default=None, help="broker URL (default: $FLIGHTDECK_NATS_URL)")
    g.add_argument("--ttl-s", type=float, default=DEFAULT_TTL_S,
                   help=f"an identity's life; an ended job's stops working within it (default {DEFAULT_TTL_S:g})")
    s = verbs.add_parser("shipped", help="the repository's config: passwords from the server's environment")
    s.add_argument("--out", type=Path, default=SHIPPED)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb == "gate":
        return run_gate(args)
    try:
        if args.verb == "shipped":
            args.out.write_text(shipped())
        else:
            text = rendered(SecretsDir(args.secrets), tuple(args.node), tuple(args.job), cost=args.cost,
                            fleet_agent=not args.no_fleet_agent, gate=args.gate)
            write_private(args.out, text)
            if args.reload:
                os.kill(int(args.reload.read_text().strip()), signal.SIGHUP)
    except (ValueError, InvalidSubjectToken, OSError) as exc:
        print(f"python -m services.shell.security: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def run_gate(args: argparse.Namespace) -> int:
    """The gate as its own process, as user `gate` (its password from the secrets directory), until SIGTERM."""
    secrets = SecretsDir(args.secrets)
    env = {**os.environ, USER: permissions.GATE, PASSWORD_FILE: str(secrets.password_file(permissions.GATE))}
    gate = Gate(job_key=secrets.job_key(), issuer_seed=secrets.issuer_seed(), ttl_s=args.ttl_s)
    configure()

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await gate.run(nats_url(args.nats), client_options(env), stop)

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    sys.exit(main())

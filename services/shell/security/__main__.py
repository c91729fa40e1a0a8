"""Write the NATS users config.

Why it works this way: docs/internals.md, "9. Security and deployment".
"""

import argparse
import os
import signal
import sys
from pathlib import Path

from flightdeck.events.subjects import InvalidSubjectToken
from flightdeck.services.shell.security import permissions, render
from flightdeck.services.shell.security.passwords import DEFAULT_COST, SecretsDir, bcrypt, write_private

SHIPPED = Path(__file__).resolve().parents[3] / "infra" / "nats" / "accounts.conf"


def rendered(secrets: SecretsDir, nodes: tuple[str, ...], *, cost: int = DEFAULT_COST, fleet_agent: bool = True) -> str:
    users = permissions.fleet(nodes, fleet_agent=fleet_agent)
    return render.render(users, render.hashed(lambda user: bcrypt(secrets.password(user), cost)))


def shipped() -> str:
    return render.render(permissions.fleet(), render.from_environment)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flightdeck.services.shell.security", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)
    r = verbs.add_parser("render", help="a deployment's users config, with hashed passwords")
    r.add_argument("--secrets", type=Path, required=True, help="directory of password files (created if missing)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--node", action="append", default=[], help="a node with its own agent-<node> user")
    r.add_argument("--cost", type=int, default=DEFAULT_COST, help="bcrypt work factor (4-31)")
    r.add_argument("--no-fleet-agent", action="store_true", help="no shared `agent` user: per-node users only")
    r.add_argument("--reload", type=Path, metavar="PIDFILE", help="SIGHUP this nats-server afterwards")
    s = verbs.add_parser("shipped", help="the repository's config: passwords from the server's environment")
    s.add_argument("--out", type=Path, default=SHIPPED)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.verb == "shipped":
            args.out.write_text(shipped())
        else:
            text = rendered(SecretsDir(args.secrets), tuple(args.node), cost=args.cost,
                            fleet_agent=not args.no_fleet_agent)
            write_private(args.out, text)
            if args.reload:
                os.kill(int(args.reload.read_text().strip()), signal.SIGHUP)
    except (ValueError, InvalidSubjectToken, OSError) as exc:
        print(f"python -m flightdeck.services.shell.security: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

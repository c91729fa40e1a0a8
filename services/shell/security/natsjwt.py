"""NATS JWTs, as nats-server's auth callout reads and writes them (nats-io/jwt v2): a header, the claims and an
ed25519 signature by an nkey, each base64url without padding. Only what the job gate needs: read an authorization
request, write a user's claims and the authorization response carrying them."""

import base64
import hashlib
import json
import os
import time
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
REQUEST_AUDIENCE = "nats-authorization-request"
GLOBAL_ACCOUNT = "$G"  # the account of a server whose users are in its config file, without accounts


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_account_seed() -> bytes:
    """A fresh account nkey seed ("SA..."): the issuer the server trusts for the users the gate admits."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)


def _verify_key(public: str) -> nacl.signing.VerifyKey:
    """An nkey public key ("A...", "N..."): base32 of a prefix byte, the 32-byte ed25519 key and a CRC16."""
    raw = base64.b32decode(public + "=" * (-len(public) % 8))
    if len(raw) != 35:
        raise ValueError(f"{public!r} is not an nkey public key")
    return nacl.signing.VerifyKey(raw[1:33])


def public_key(seed: bytes) -> str:
    return nkeys.from_seed(seed).public_key.decode()


def encode(claims: dict[str, Any], seed: bytes) -> str:
    """Sign `claims` (iss and iat set here, jti their hash) with the nkey of `seed`."""
    kp = nkeys.from_seed(seed)
    body = {**claims, "iss": kp.public_key.decode(), "iat": int(time.time())}
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()).decode() \
        .rstrip("=")
    signing = f"{_b64(json.dumps(HEADER).encode())}.{_b64(json.dumps(body).encode())}"
    return f"{signing}.{_b64(kp.sign(signing.encode()))}"


def decode(token: str, *, verify: bool = True) -> dict[str, Any]:
    """The claims of a JWT; with `verify`, only if its signature is its issuer's (an nkey public key)."""
    try:
        head, body, sig = token.split(".")
        claims: dict[str, Any] = json.loads(_unb64(body))
        if verify:
            _verify_key(claims["iss"]).verify(f"{head}.{body}".encode(), _unb64(sig))
    except (ValueError, KeyError, TypeError, nkeys.NkeysError, nacl.exceptions.BadSignatureError) as exc:
        raise ValueError(f"not a valid NATS JWT: {exc!r}") from None
    return claims


def user_claims(*, user_nkey: str, name: str, publish: list[str], subscribe: list[str], expires_at: int,
                publish_deny: list[str] | None = None, account: str = GLOBAL_ACCOUNT) -> dict[str, Any]:
    pub: dict[str, list[str]] = {"allow": publish}
    if publish_deny:
        pub["deny"] = publish_deny
    return {"sub": user_nkey, "name": name, "aud": account, "exp": expires_at,
            "nats": {"pub": pub, "sub": {"allow": subscribe}, "subs": -1, "data": -1, "payload": -1,
                     "type": "user", "version": 2}}


def response_claims(*, user_nkey: str, server_id: str, user_jwt: str = "", error: str = "") -> dict[str, Any]:
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if user_jwt:
        nats["jwt"] = user_jwt
    if error:
        nats["error"] = error
    return {"sub": user_nkey, "aud": server_id, "nats": nats}

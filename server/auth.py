"""Identity: API keys and JWTs, checked by an ASGI middleware in front of every route but the probes
and the docs.

A request carries ``Authorization: Bearer <key or JWT>`` or ``Authorization: Api-Key <key>``. API keys
come from the settings and from a keys file (one ``key`` or ``key user`` per line); JWTs are verified
with PyJWT against an HMAC secret, a PEM public key or a local JWKS file. The verified identity is a
:class:`Principal`, available to handlers through :func:`principal_of`. With no key and no JWT key
configured the server is open and every request is the anonymous user (:func:`open_mode_warning`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from litestar import Request
from litestar.types import ASGIApp, Receive, Scope, Send

from server.context import request_log
from server.errors import APIError, error_body

ANONYMOUS = "anonymous"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs"})
_REALM = 'Bearer realm="trellis"'
_HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
_PUBLIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
_principal: ContextVar[Principal | None] = ContextVar("trellis_principal", default=None)


class AuthConfigError(ValueError):
    """The authentication settings cannot be used (unreadable file, bad key, bad algorithm list)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is making the request: the user id that owns stored data, and how it was established."""

    user: str
    via: Literal["api_key", "jwt", "open"]


# --------------------------------------------------------------------------- API keys


def key_user_id(key: str) -> str:
    """The stable user id of a key that names no user (derived from its hash, never the key itself)."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def read_keys_file(path: str | Path) -> dict[str, str]:
    """``key`` or ``key user`` per line; blank lines and ``#`` comments are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise AuthConfigError(f"cannot read the API keys file {str(path)!r}: {exc.strerror}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise AuthConfigError(f"{path}:{number}: expected 'key' or 'key user'")
        keys[fields[0]] = fields[1] if len(fields) == 2 else key_user_id(fields[0])
    return keys


class KeyRing:
    """API keys compared in constant time: the candidate's hash against every stored hash, no early exit.

    Comparing SHA-256 digests (always 32 bytes) also hides the stored keys' lengths.
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._entries = [(hashlib.sha256(key.encode()).digest(), user) for key, user in keys.items()]

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, candidate: str) -> str | None:
        """The user of ``candidate``, or None when it is no key of ours."""
        digest = hashlib.sha256(candidate.encode("utf-8", "surrogateescape")).digest()
        found = None
        for stored, user in self._entries:
            if hmac.compare_digest(digest, stored):
                found = user
        return found


# --------------------------------------------------------------------------- JWT


def _algorithm_for(key: Any) -> str:
    if isinstance(key, rsa.RSAPublicKey):
        return "RS256"
    if isinstance(key, ec.EllipticCurvePublicKey):
        return {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}.get(key.curve.name, "ES256")
    if isinstance(key, ed25519.Ed25519PublicKey):
        return "EdDSA"
    raise AuthConfigError(f"unsupported public key type {type(key).__name__}")


def _checked_algorithms(algorithms: Sequence[str], allowed: frozenset[str], what: str) -> list[str]:
    bad = [name for name in algorithms if name not in allowed]
    if bad:
        raise AuthConfigError(f"JWT algorithm(s) {', '.join(bad)} cannot be used with {what}")
    return list(algorithms)


class JWTVerifier:
    """Verifies a JWT's signature, ``exp``/``nbf`` and (when configured) ``iss``/``aud``.

    Build it with :meth:`from_secret`, :meth:`from_pem_file` or :meth:`from_jwks_file`. The algorithm
    list is pinned per key kind, so an HMAC secret never verifies an RS/ES token and vice versa.
    """

    def __init__(
        self,
        keys: Mapping[str | None, Any],
        algorithms: Sequence[str],
        *,
        issuer: str | None = None,
        audience: str | None = None,
        leeway: float = 0.0,
        require_exp: bool = True,
    ) -> None:
        self._keys = dict(keys)
        self.algorithms = list(algorithms)
        self.issuer = issuer or None
        self.audience = audience or None
        self.leeway = leeway
        self._require = ["sub", "exp"] if require_exp else ["sub"]

    @classmethod
    def from_secret(cls, secret: str, algorithms: Sequence[str] = (), **options: Any) -> JWTVerifier:
        """HS256 (or the given HMAC algorithms) with a shared secret."""
        algs = _checked_algorithms(algorithms or ["HS256"], _HMAC_ALGORITHMS, "a shared secret")
        return cls({None: secret.encode()}, algs, **options)

    @classmethod
    def from_pem_file(cls, path: str | Path, algorithms: Sequence[str] = (), **options: Any) -> JWTVerifier:
        """A PEM public key (RSA, EC or Ed25519); the algorithm follows the key type unless given."""
        try:
            key = load_pem_public_key(Path(path).read_bytes())
        except OSError as exc:
            raise AuthConfigError(f"cannot read the JWT public key {str(path)!r}: {exc.strerror}") from None
        except ValueError as exc:
            raise AuthConfigError(f"{path} is not a PEM public key: {exc}") from None
        algs = _checked_algorithms(algorithms or [_algorithm_for(key)], _PUBLIC_ALGORITHMS, "a public key")
        return cls({None: key}, algs, **options)

    @classmethod
    def from_jwks_file(cls, path: str | Path, algorithms: Sequence[str] = (), **options: Any) -> JWTVerifier:
        """A local JWKS file (``{"keys": [...]}``); tokens pick their key by ``kid``."""
        try:
            jwks = jwt.PyJWKSet.from_json(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise AuthConfigError(f"cannot read the JWKS file {str(path)!r}: {exc.strerror}") from None
        except (jwt.PyJWTError, ValueError) as exc:
            raise AuthConfigError(f"{path} is not a usable JWKS: {exc}") from None
        keys = {jwk.key_id: jwk.key for jwk in jwks.keys}
        found = sorted({jwk.algorithm_name for jwk in jwks.keys})
        algs = _checked_algorithms(algorithms or found, _PUBLIC_ALGORITHMS, "a JWKS")
        return cls(keys, algs, **options)

    def _key_for(self, token: str) -> Any:
        if len(self._keys) == 1 and None in self._keys:
            return self._keys[None]
        kid = jwt.get_unverified_header(token).get("kid")
        if kid in self._keys:
            return self._keys[kid]
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        raise jwt.InvalidTokenError("no key in the JWKS matches the token's 'kid'")

    def verify(self, token: str) -> dict[str, Any]:
        """The token's claims; raises ``jwt.InvalidTokenError`` (or a subclass) when it does not verify."""
        return jwt.decode(
            token,
            self._key_for(token),
            algorithms=self.algorithms,
            issuer=self.issuer,
            audience=self.audience,
            leeway=self.leeway,
            options={"require": self._require, "verify_aud": self.audience is not None},
        )


_JWT_MESSAGES: tuple[tuple[type[Exception], str], ...] = (
    (jwt.ExpiredSignatureError, "the token has expired"),
    (jwt.ImmatureSignatureError, "the token is not valid yet"),
    (jwt.InvalidAudienceError, "the token is not meant for this server (audience)"),
    (jwt.InvalidIssuerError, "the token was issued by an issuer this server does not accept"),
    (jwt.InvalidSignatureError, "the token's signature does not verify"),
    (jwt.InvalidAlgorithmError, "the token is signed with an algorithm this server does not accept"),
)


def _jwt_message(exc: Exception) -> str:
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"the token has no '{exc.claim}' claim"
    for kind, message in _JWT_MESSAGES:
        if isinstance(exc, kind):
            return message
    return "the token is not a valid JWT"


# --------------------------------------------------------------------------- authenticator


def _unauthorized(message: str, code: str) -> APIError:
    challenge = _REALM
    if code == "invalid_token":
        challenge += f', error="invalid_token", error_description="{message}"'
    return APIError(message, status=401, code=code, headers={"WWW-Authenticate": challenge})


def _header(headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    if isinstance(headers, Mapping):
        return headers.get(name) or headers.get(name.title())
    raw = name.encode()
    for key, value in headers:
        if key.lower() == raw:
            return value.decode("latin-1")
    return None


class Authenticator:
    """Turns a request's ``Authorization`` header into a :class:`Principal`.

    ``keys`` maps API key -> user id; ``jwt`` verifies tokens. With neither, every request is open.
    """

    def __init__(self, keys: Mapping[str, str] | None = None, jwt_verifier: JWTVerifier | None = None) -> None:
        self.keys = KeyRing(keys or {})
        self.jwt = jwt_verifier

    @property
    def open(self) -> bool:
        """True when nothing is configured: no check at all, everyone is the anonymous user."""
        return len(self.keys) == 0 and self.jwt is None

    @classmethod
    def from_settings(cls, settings: Any) -> Authenticator:
        """Build from the server settings (``api_keys``, ``api_keys_file``, ``jwt_*``; missing ones are off)."""
        keys = {key: key_user_id(key) for key in _split(getattr(settings, "api_keys", ""))}
        keys_file = getattr(settings, "api_keys_file", "")
        if keys_file:
            keys.update(read_keys_file(keys_file))
        return cls(keys, _verifier_from_settings(settings))

    def require(self, headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]]) -> Principal:
        """The principal, or an :class:`APIError` (401, ``invalid_api_key``/``invalid_token``) to answer with."""
        if self.open:
            return Principal(ANONYMOUS, "open")
        value = _header(headers, "authorization")
        if not value or not value.strip():
            raise self._missing()
        scheme, _, credential = value.strip().partition(" ")
        credential = credential.strip()
        scheme = scheme.lower()
        if scheme not in ("bearer", "api-key") or not credential:
            raise self._missing()
        user = self.keys.lookup(credential)
        if user is not None:
            return Principal(user, "api_key")
        if scheme == "bearer" and self.jwt is not None and credential.count(".") == 2:
            return self._from_token(credential)
        raise _unauthorized("the API key is not valid", "invalid_api_key")

    def authenticate(self, headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]]) -> Principal | None:
        """The principal, or None when the credentials are missing or wrong."""
        try:
            return self.require(headers)
        except APIError:
            return None

    def _missing(self) -> APIError:
        accepted = "'Authorization: Bearer <API key or JWT>'" if self.jwt else "'Authorization: Bearer <API key>'"
        code = "invalid_api_key" if len(self.keys) else "invalid_token"
        return _unauthorized(f"no credentials: send {accepted}", code)

    def _from_token(self, token: str) -> Principal:
        assert self.jwt is not None
        try:
            claims = self.jwt.verify(token)
        except jwt.PyJWTError as exc:
            raise _unauthorized(_jwt_message(exc), "invalid_token") from None
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise _unauthorized("the token has no 'sub' claim", "invalid_token")
        if "\x00" in subject:
            raise _unauthorized("the token's 'sub' claim contains a NUL character", "invalid_token")
        return Principal(subject, "jwt")

    def describe(self) -> str:
        """One start-up log line naming what is accepted (never a key)."""
        if self.open:
            return open_mode_warning(self) or ""
        parts = []
        if len(self.keys):
            parts.append(f"{len(self.keys)} API key(s)")
        if self.jwt is not None:
            extra = "".join(f", {k}={v}" for k, v in (("iss", self.jwt.issuer), ("aud", self.jwt.audience)) if v)
            parts.append(f"JWT ({'/'.join(self.jwt.algorithms)}{extra})")
        return "authentication: " + " and ".join(parts)


def _split(text: str | Sequence[str] | None) -> list[str]:
    if not text:
        return []
    items = text.split(",") if isinstance(text, str) else text
    return [item.strip() for item in items if item.strip()]


def _verifier_from_settings(settings: Any) -> JWTVerifier | None:
    options = {
        "issuer": getattr(settings, "jwt_issuer", "") or None,
        "audience": getattr(settings, "jwt_audience", "") or None,
        "leeway": float(getattr(settings, "jwt_leeway", 0.0) or 0.0),
    }
    algorithms = _split(getattr(settings, "jwt_algorithms", ""))
    sources = [(name, getattr(settings, name, "")) for name in ("jwt_secret", "jwt_public_key", "jwt_jwks_file")]
    given = [(name, value) for name, value in sources if value]
    if len(given) > 1:
        raise AuthConfigError("give only one of --jwt-secret, --jwt-public-key and --jwt-jwks-file")
    if not given:
        return None
    name, value = given[0]
    build = {
        "jwt_secret": JWTVerifier.from_secret,
        "jwt_public_key": JWTVerifier.from_pem_file,
        "jwt_jwks_file": JWTVerifier.from_jwks_file,
    }[name]
    return build(value, algorithms, **options)


def open_mode_warning(authenticator: Authenticator) -> str | None:
    """The start-up warning for a server without authentication, or None when keys or JWTs are configured."""
    if not authenticator.open:
        return None
    return ("authentication is OFF: no API key and no JWT key is configured, so every client is the "
            f"'{ANONYMOUS}' user and can read every stored completion and conversation "
            "(set --api-keys, --api-keys-file or --jwt-secret / --jwt-public-key / --jwt-jwks-file)")


# --------------------------------------------------------------------------- middleware + access


def is_open_path(path: str) -> bool:
    """Probes and the API docs need no credentials."""
    return path in OPEN_PATHS or path.startswith("/docs/")


class AuthMiddleware:
    """ASGI middleware factory (like ``Envelope``): ``Litestar(middleware=[envelope, AuthMiddleware(auth)])``.

    Sets ``scope["user"]`` (so ``request.user`` works) and a contextvar to the :class:`Principal`, or
    answers 401 with the OpenAI error body and a ``WWW-Authenticate`` challenge. Litestar runs app
    middleware around each route handler, so a path with no route is a 404 before any check.
    """

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    def __call__(self, app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or is_open_path(scope.get("path", "")):
                await app(scope, receive, send)
                return
            try:
                principal = self.authenticator.require(scope.get("headers") or [])
            except APIError as error:
                request_log().update(auth_failed=error.code)
                await _send_error(send, error)
                return
            scope["user"] = principal  # type: ignore[typeddict-unknown-key]
            scope["auth"] = principal.via  # type: ignore[typeddict-unknown-key]
            _principal.set(principal)
            request_log().update(user=principal.user, auth=principal.via)
            await app(scope, receive, send)

        return middleware


async def _send_error(send: Send, error: APIError) -> None:
    request_log().update(error_code=error.code)
    body = error_body(error)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode("latin-1")) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def current_principal() -> Principal | None:
    """The principal the middleware set for this request (None outside an authenticated request)."""
    return _principal.get()


def principal_of(request: Request) -> Principal:
    """The request's principal; 401 when no auth middleware ran (fails closed, never anonymous)."""
    principal = request.scope.get("user")
    if isinstance(principal, Principal):
        return principal
    principal = current_principal()
    if principal is None:
        raise _unauthorized("this route needs authentication, and none ran", "invalid_api_key")
    return principal


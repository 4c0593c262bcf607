"""Identity over real HTTP: API keys in both header forms, JWTs (HS256, RS256 from a PEM file, ES256
from a JWKS file), open mode, the 401 body and challenge, and the probes that need no credentials."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from litestar import Request, get

from server import auth
from server.auth import (
    AuthConfigError,
    Authenticator,
    JWTVerifier,
    KeyRing,
    Principal,
    key_user_id,
    open_mode_warning,
    principal_of,
    read_keys_file,
)
from server.errors import APIError
from tests.server.store_fixtures import build_app, serve

SECRET = "s3cret-0123456789-0123456789-abcdef"  # >= 32 bytes: PyJWT warns about shorter HMAC keys
KEY_ALICE = "sk-alice-0123456789"
KEY_ANON = "sk-unnamed-abcdef"


@get("/whoami")
async def whoami(request: Request) -> dict:
    principal = principal_of(request)
    return {"user": principal.user, "via": principal.via}


@get("/health")
async def health() -> dict:
    return {"status": "ok"}


@pytest.fixture
def run_app() -> Iterator:
    """Start an app for an Authenticator; every server started is stopped at the end of the test."""
    stops = []

    def start(authenticator: Authenticator) -> httpx.Client:
        base, stop = serve(build_app(authenticator, extra=[whoami, health]))
        client = httpx.Client(base_url=base, timeout=10)
        stops.extend([client.close, stop])
        return client

    yield start
    for stop in stops:
        stop()


def _token(claims: dict, key=SECRET, algorithm="HS256", headers=None) -> str:
    body = {"sub": "bob", "exp": int(time.time()) + 600, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm=algorithm, headers=headers)


def _assert_401(response: httpx.Response, code: str) -> dict:
    assert response.status_code == 401, response.text
    body = response.json()
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == code and body["code"] == code
    assert body["error"]["param"] is None
    assert body["message"] == body["error"]["message"]
    assert response.headers["www-authenticate"].startswith('Bearer realm="trellis"')
    assert response.headers["content-type"] == "application/json"
    return body


# --------------------------------------------------------------------------- API keys


@pytest.fixture
def keyed(run_app, tmp_path) -> httpx.Client:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# team keys\n{KEY_ALICE} alice\n\n{KEY_ANON}\n")
    settings = SimpleNamespace(api_keys="sk-carol-key, ", api_keys_file=str(keys_file))
    return run_app(Authenticator.from_settings(settings))


def test_api_key_bearer_and_api_key_header(keyed):
    assert keyed.get("/whoami", headers={"Authorization": f"Bearer {KEY_ALICE}"}).json() == {"user": "alice", "via": "api_key"}
    assert keyed.get("/whoami", headers={"Authorization": f"Api-Key {KEY_ALICE}"}).json()["user"] == "alice"
    assert keyed.get("/whoami", headers={"Authorization": f"bearer   {KEY_ALICE}"}).json()["user"] == "alice"
    assert keyed.get("/whoami", headers={"Authorization": f"Bearer {KEY_ANON}"}).json()["user"] == key_user_id(KEY_ANON)
    assert keyed.get("/whoami", headers={"Authorization": "Bearer sk-carol-key"}).json()["user"] == key_user_id("sk-carol-key")


def test_wrong_or_missing_key_is_401_with_error_body(keyed):
    body = _assert_401(keyed.get("/whoami", headers={"Authorization": "Bearer sk-wrong"}), "invalid_api_key")
    assert "sk-wrong" not in json.dumps(body)
    _assert_401(keyed.get("/whoami", headers={"Authorization": f"Api-Key {KEY_ALICE}x"}), "invalid_api_key")
    _assert_401(keyed.get("/whoami"), "invalid_api_key")
    _assert_401(keyed.get("/whoami", headers={"Authorization": f"Basic {KEY_ALICE}"}), "invalid_api_key")
    _assert_401(keyed.get("/whoami", headers={"Authorization": "Bearer"}), "invalid_api_key")
    # The store routes are behind the check too (Litestar runs app middleware per route, so an
    # unknown path is a plain 404 either way).
    _assert_401(keyed.get("/v1/chat/completions"), "invalid_api_key")
    _assert_401(keyed.post("/v1/conversations", json={}), "invalid_api_key")


def test_probes_and_docs_need_no_credentials(keyed):
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/docs/openapi.json").status_code != 401


def test_key_comparison_checks_every_key(monkeypatch):
    ring = KeyRing({f"key-{i}": f"user-{i}" for i in range(5)})
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert ring.lookup("key-0") == "user-0"  # a match on the first key still compares all five
    assert ring.lookup("nope") is None
    assert len(calls) == 10


def test_keys_file_format(tmp_path):
    path = tmp_path / "keys"
    path.write_text("a1 alice  # comment\n  b2\n# only a comment\n")
    assert read_keys_file(path) == {"a1": "alice", "b2": key_user_id("b2")}
    path.write_text("a b c\n")
    with pytest.raises(AuthConfigError, match="key user"):
        read_keys_file(path)
    with pytest.raises(AuthConfigError, match="cannot read"):
        read_keys_file(tmp_path / "missing")


# --------------------------------------------------------------------------- JWT


@pytest.fixture
def hs256(run_app) -> httpx.Client:
    verifier = JWTVerifier.from_secret(SECRET, issuer="https://issuer.test", audience="trellis")
    return run_app(Authenticator({KEY_ALICE: "alice"}, verifier))


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_jwt_hs256_valid(hs256):
    token = _token({"iss": "https://issuer.test", "aud": "trellis"})
    assert hs256.get("/whoami", headers=_bearer(token)).json() == {"user": "bob", "via": "jwt"}
    # API keys keep working next to JWTs.
    assert hs256.get("/whoami", headers=_bearer(KEY_ALICE)).json()["user"] == "alice"


@pytest.mark.parametrize(
    ("claims", "key", "message"),
    [
        (lambda: {"exp": int(time.time()) - 60}, SECRET, "expired"),  # times taken when the test runs,
        (lambda: {"nbf": int(time.time()) + 600}, SECRET, "not valid yet"),  # not at collection
        ({"aud": "someone-else"}, SECRET, "audience"),
        ({"iss": "https://evil.test"}, SECRET, "issuer"),
        ({}, "another-secret-0123456789-0123456789", "signature"),
        ({"sub": None}, SECRET, "'sub'"),
        ({"sub": "a\x00b"}, SECRET, "NUL"),
        ({"exp": None}, SECRET, "'exp'"),
    ],
    ids=["expired", "not-yet", "wrong-aud", "wrong-iss", "wrong-signature", "no-sub", "nul-sub", "no-exp"],
)
def test_jwt_hs256_rejected(hs256, claims, key, message):
    claims = claims() if callable(claims) else claims
    token = _token({"iss": "https://issuer.test", "aud": "trellis", **claims}, key=key)
    body = _assert_401(hs256.get("/whoami", headers=_bearer(token)), "invalid_token")
    assert message in body["error"]["message"]


def test_jwt_challenge_names_the_error(hs256):
    token = _token({"iss": "https://issuer.test", "aud": "trellis", "exp": 1})
    response = hs256.get("/whoami", headers=_bearer(token))
    assert 'error="invalid_token"' in response.headers["www-authenticate"]


def test_jwt_not_accepted_in_api_key_header(hs256):
    token = _token({"iss": "https://issuer.test", "aud": "trellis"})
    _assert_401(hs256.get("/whoami", headers={"Authorization": f"Api-Key {token}"}), "invalid_api_key")


def _pem(private_key) -> bytes:
    return private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_jwt_rs256_public_key_file(run_app, tmp_path):
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = tmp_path / "jwt.pem"
    pem.write_bytes(_pem(private))
    settings = SimpleNamespace(jwt_public_key=str(pem), jwt_audience="trellis")
    client = run_app(Authenticator.from_settings(settings))
    good = _token({"aud": "trellis"}, key=private, algorithm="RS256")
    assert client.get("/whoami", headers=_bearer(good)).json() == {"user": "bob", "via": "jwt"}
    forged = _token({"aud": "trellis"}, key=other, algorithm="RS256")
    assert "signature" in _assert_401(client.get("/whoami", headers=_bearer(forged)), "invalid_token")["error"]["message"]
    # Algorithm confusion: an HS256 token "signed" with the public PEM must not pass.
    header = {"alg": "HS256", "typ": "JWT"}
    payload = json.dumps({"sub": "mallory", "exp": int(time.time()) + 600, "aud": "trellis"}).encode()
    token = _forge_hs256(header, payload, pem.read_bytes())
    _assert_401(client.get("/whoami", headers=_bearer(token)), "invalid_token")
    assert client.get("/whoami").status_code == 401  # JWT-only server: missing credentials
    assert client.get("/whoami").json()["error"]["code"] == "invalid_token"


def _forge_hs256(header: dict, payload: bytes, secret: bytes) -> str:
    import base64
    import hashlib

    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    signing_input = b64(json.dumps(header).encode()) + b"." + b64(payload)
    signature = hmac.new(secret, signing_input, hashlib.sha256).digest()
    return (signing_input + b"." + b64(signature)).decode()


def test_jwt_es256_jwks_file(run_app, tmp_path):
    private = ec.generate_private_key(ec.SECP256R1())
    jwk = jwt.algorithms.ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "alg": "ES256", "use": "sig"}]}))
    client = run_app(Authenticator(jwt_verifier=JWTVerifier.from_jwks_file(jwks)))
    good = _token({}, key=private, algorithm="ES256", headers={"kid": "k1"})
    assert client.get("/whoami", headers=_bearer(good)).json() == {"user": "bob", "via": "jwt"}
    unknown_kid = _token({}, key=private, algorithm="ES256", headers={"kid": "k2"})
    _assert_401(client.get("/whoami", headers=_bearer(unknown_kid)), "invalid_token")
    _assert_401(client.get("/whoami", headers=_bearer("a.b.c")), "invalid_token")


def test_jwt_config_errors(tmp_path):
    with pytest.raises(AuthConfigError, match="cannot be used"):
        JWTVerifier.from_secret(SECRET, ["RS256"])
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    with pytest.raises(AuthConfigError, match="not a PEM public key"):
        JWTVerifier.from_pem_file(bad)
    with pytest.raises(AuthConfigError, match="only one"):
        Authenticator.from_settings(SimpleNamespace(jwt_secret=SECRET, jwt_jwks_file=str(bad)))


# --------------------------------------------------------------------------- open mode


def test_open_mode(run_app):
    authenticator = Authenticator.from_settings(SimpleNamespace())
    assert authenticator.open
    warning = open_mode_warning(authenticator)
    assert warning and "OFF" in warning
    client = run_app(authenticator)
    assert client.get("/whoami").json() == {"user": "anonymous", "via": "open"}
    assert client.get("/whoami", headers=_bearer("anything")).json()["via"] == "open"


def test_describe_never_shows_keys():
    authenticator = Authenticator({KEY_ALICE: "alice"}, JWTVerifier.from_secret(SECRET, audience="trellis"))
    line = authenticator.describe()
    assert open_mode_warning(authenticator) is None
    assert KEY_ALICE not in line and SECRET not in line
    assert "1 API key" in line and "HS256" in line and "aud=trellis" in line


def test_principal_fails_closed_without_middleware():
    request = SimpleNamespace(scope={})
    with pytest.raises(APIError) as info:
        principal_of(request)  # type: ignore[arg-type]
    assert info.value.status == 401
    assert principal_of(SimpleNamespace(scope={"user": Principal("u", "jwt")})).user == "u"  # type: ignore[arg-type]

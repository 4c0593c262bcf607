"""The `trellis` command line: help text, env-var settings and one-line model errors."""

import subprocess
import sys

from server.cli import build_parser
from server.config import settings_from_args


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_help_documents_every_option():
    out = run_cli("serve", "--help").stdout
    for flag in ("--model", "--served-model-name", "--host", "--port", "--max-batch-size", "--max-model-len",
                 "--dtype", "--device", "TRELLIS_PORT"):
        assert flag in out


def test_env_variables_set_defaults(monkeypatch):
    monkeypatch.setenv("TRELLIS_PORT", "9123")
    monkeypatch.setenv("TRELLIS_JUMP_FORWARD", "off")
    args = build_parser().parse_args(["serve"])
    settings = settings_from_args(args)
    assert settings.port == 9123 and settings.jump_forward is False


def test_missing_model_is_one_line_error(tmp_path):
    result = run_cli("serve", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "model not found" in result.stderr


def test_directory_without_config_is_one_line_error(tmp_path):
    result = run_cli("serve", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "no config.json" in result.stderr and "Traceback" not in result.stderr


def test_api_key_flag_repeats_and_secrets_stay_out_of_help(monkeypatch):
    monkeypatch.setenv("TRELLIS_API_KEYS", "sk-from-env")
    monkeypatch.setenv("TRELLIS_JWT_SECRET", "very-secret")
    parser = build_parser()
    settings = settings_from_args(parser.parse_args(["serve", "--api-key", "sk-a", "--api-key", "sk-b"]))
    assert settings.api_keys.split(",") == ["sk-from-env", "sk-a", "sk-b"]
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    assert "sk-from-env" not in help_text and "very-secret" not in help_text
    assert "--database-url" in help_text and "--jwt-public-key" in help_text


def test_batch_invariant_flag(monkeypatch):
    assert settings_from_args(build_parser().parse_args(["serve"])).batch_invariant is False
    assert settings_from_args(build_parser().parse_args(["serve", "--batch-invariant", "on"])).batch_invariant is True
    monkeypatch.setenv("TRELLIS_BATCH_INVARIANT", "on")
    assert settings_from_args(build_parser().parse_args(["serve"])).batch_invariant is True


def test_enforce_eager_flag_and_env(monkeypatch):
    assert settings_from_args(build_parser().parse_args(["serve"])).enforce_eager is False
    assert settings_from_args(build_parser().parse_args(["serve", "--enforce-eager"])).enforce_eager is True
    monkeypatch.setenv("TRELLIS_ENFORCE_EAGER", "on")
    assert settings_from_args(build_parser().parse_args(["serve"])).enforce_eager is True
    assert settings_from_args(build_parser().parse_args(["serve", "--enforce-eager", "off"])).enforce_eager is False

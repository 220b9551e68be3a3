"""The scorer service's bearer token, on both sides: `esrl serve-scorer` requires one by default, and the client
(HTTPScorer) finds the same one.

Where the token comes from, first found wins: the explicit value (`--token`, `token=`), a token file (`--token-file`
for the service; the environment variable ESRL_SCORER_TOKEN_FILE for both), the environment variable
ESRL_SCORER_TOKEN. With none of them the service generates one and prints it once; given a token file that does not
exist yet, it writes the generated token there (mode 600) for clients to read. `--no-token` serves without one,
on a loopback address only.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from esrl.errors import ConfigError, read_text

ENV = "ESRL_SCORER_TOKEN"
ENV_FILE = "ESRL_SCORER_TOKEN_FILE"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def header_token(token: str, source: str) -> str:
    """A token as an HTTP header carries it: printable ASCII, no spaces. httpx raised UnicodeEncodeError from inside
    a request (or the server's check) for a token such as 'clé', naming neither the token nor where it came from."""
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigError(f"{source}: a token must be printable ASCII without spaces (it is sent in an HTTP header)")
    return token


def read_token_file(path: str | Path) -> str:
    path = Path(path).expanduser()
    try:
        token = read_text(path, "scorer token file").strip()
    except OSError as e:
        raise ConfigError(f"scorer token file {path}: cannot read it ({e.strerror or e})") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"scorer token file {path}: expected one token (no spaces), got "
                          f"{'nothing' if not token else 'several words'}")
    return header_token(token, f"scorer token file {path}")


def client_token(token: str | None = None) -> str | None:
    """The token a client sends: `token`, else ESRL_SCORER_TOKEN_FILE's content, else ESRL_SCORER_TOKEN."""
    if token:
        return header_token(token, "the scorer's token (data.task_args.token)")
    if os.environ.get(ENV_FILE):
        return read_token_file(os.environ[ENV_FILE])
    return header_token(os.environ[ENV], ENV) if os.environ.get(ENV) else None


def check_token_options(token: str | None, token_file: str | None, no_token: bool, host: str) -> None:
    """The token options' conflicts and an existing token file, checked before the models load (server_token,
    which may print a new token, runs once they have)."""
    if no_token:
        if token or token_file:
            raise ConfigError("--no-token with --token or --token-file; choose one")
        if host not in LOOPBACK:
            raise ConfigError(f"--no-token serves anyone who can reach it: allowed on a loopback "
                              f"--host ({', '.join(LOOPBACK)}) only, got {host}")
        return
    if token:
        header_token(token, "--token")
    elif not (token_file or os.environ.get(ENV_FILE)) and os.environ.get(ENV):
        header_token(os.environ[ENV], ENV)
    file = token_file or os.environ.get(ENV_FILE)
    if not token and file and Path(file).expanduser().exists():
        read_token_file(file)
    elif not token and file:  # to be written once the models load: its folder must be one it can make and write
        folder = next(p for p in Path(file).expanduser().absolute().parents if p.exists())
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"--token-file {file}: cannot write it ({folder} is "
                              f"{'a file' if not folder.is_dir() else 'not writable'})")


def server_token(token: str | None, token_file: str | None, no_token: bool, host: str) -> str | None:
    """The token `esrl serve-scorer` requires (None only with --no-token on a loopback address)."""
    check_token_options(token, token_file, no_token, host)
    if no_token:
        return None
    if token:
        return token
    file = token_file or os.environ.get(ENV_FILE)
    if file and Path(file).expanduser().exists():
        return read_token_file(file)
    if not file and os.environ.get(ENV):
        return os.environ[ENV]
    new = secrets.token_urlsafe(32)
    if file:
        path = Path(file).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        # written whole beside it, then linked into place (fails as O_EXCL would if it exists): a kill or a full disk
        # mid-write once left an empty token file that every later start and client refused
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(new + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # a file system without hard links: create it exclusively, as before
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(new + "\n")
        finally:
            tmp.unlink(missing_ok=True)
        print(f"esrl serve-scorer: wrote a new token to {path} (clients: {ENV_FILE}={path})", file=sys.stderr)
    else:
        print(f"esrl serve-scorer: token {new} (clients send 'Authorization: Bearer TOKEN'; esrl reads it from "
              f"{ENV} or a file named by {ENV_FILE})", file=sys.stderr, flush=True)
    return new

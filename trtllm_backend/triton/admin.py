"""Triton's administrative APIs closed by default.

tritonserver serves its shared-memory, model-repository (load / unload / index), logging and trace APIs to
anyone who reaches its HTTP or gRPC port. The launcher restricts them with Triton's own flags
(`--http-restricted-api`, `--grpc-restricted-protocol`): a request to one of them must carry the server's key in
the HTTP header `morphserve-admin-key`, or over gRPC in the metadata `triton-grpc-protocol-morphserve-admin-key`
(Triton adds that prefix to the name given on its command line). Inference, health, metadata, model configuration and
statistics stay open, as clients expect.

The key: the operator's (`$MORPHSERVE_ADMIN_KEY`, or `launch(admin_key=...)`), else a random one per start. The
command line writes a generated key to a file only its user can read (`key_file`) and prints the file's path,
never the key (unless asked with --print-admin-key). `open_admin` keeps the old behaviour: every API open.
NOTE: Triton takes the key on its command line, so a local user who can list processes can read it there; the
restriction guards the network, not the host.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from .. import env_vars

ADMIN_HEADER = "morphserve-admin-key"  # lower case: gRPC metadata keys must be
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER  # what Triton's gRPC frontend looks for
ADMIN_KEY_ENV = env_vars.ADMIN_KEY.name
OPEN_ADMIN_ENV = env_vars.OPEN_ADMIN.name
KEY_FILE_ENV = env_vars.ADMIN_KEY_FILE.name
# Triton 2.51's categories (`tritonserver --help`): health, metadata, inference, shared-memory, model-config,
# model-repository, statistics, trace, logging. The first three and model-config/statistics reads stay open.
RESTRICTED = ("shared-memory", "model-repository", "logging", "trace")
HTTP_FLAG = "--http-restricted-api"
GRPC_FLAG = "--grpc-restricted-protocol"
_TRUE = {"1", "true", "yes", "on"}


def new_key() -> str:
    """43 URL-safe characters (256 bits): no ':', ',' or '=' that Triton's flag syntax would split on."""
    return secrets.token_urlsafe(32)


def key_from_env(env: dict[str, str] | None = None) -> str | None:
    value = (os.environ if env is None else env).get(ADMIN_KEY_ENV, "").strip()
    return value or None


def open_from_env(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(OPEN_ADMIN_ENV, "").strip().lower() in _TRUE


def check_key(key: str) -> str:
    if not key or any(c in key for c in ":,= \t\n") or not key.isprintable():
        raise ValueError(
            f"${ADMIN_KEY_ENV}: the admin key must be non-empty, printable, without spaces, ':', ',' or '='"
        )
    return key


def restricted_args(key: str, extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The tritonserver flags that close RESTRICTED on both protocols behind `key`. A protocol whose flag the
    operator already passes (extra_args) is left to the operator's."""
    check_key(key)
    out = []
    for flag in (HTTP_FLAG, GRPC_FLAG):
        if any(a == flag or a.startswith(flag + "=") for a in extra_args):
            continue
        out.append(f"{flag}={','.join(RESTRICTED)}:{ADMIN_HEADER}={key}")
    return out


def headers(key: str | None) -> dict[str, str]:
    """The headers that open the admin APIs on both protocols (each ignores the other's): pass as `headers=` to
    tritonclient's HTTP or gRPC calls. Empty when `key` is None (the APIs are open)."""
    return {ADMIN_HEADER: key, GRPC_ADMIN_HEADER: key} if key else {}


def redact(args: list[str], key: str | None) -> list[str]:
    """A command line fit for a log: the key replaced."""
    return [a.replace(key, "<admin-key>") for a in args] if key else list(args)


def default_key_file(http_port: int, env: dict[str, str] | None = None) -> Path:
    """`$MORPHSERVE_ADMIN_KEY_FILE`, else `admin-key.<http port>` in a folder of this user's only:
    `$XDG_RUNTIME_DIR/morphserve/`, else `<tmp>/morphserve-<uid>/`."""
    env = os.environ if env is None else env
    if env.get(KEY_FILE_ENV):
        return Path(env[KEY_FILE_ENV])
    runtime = env.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "morphserve" if runtime else Path(tempfile.gettempdir()) / f"morphserve-{os.getuid()}"
    return folder / f"admin-key.{http_port}"


def write_key_file(path: Path, key: str) -> Path:
    """Write `key` to `path` with mode 0600 (its folder created 0700 when missing). Refuses a folder another user
    owns or others can write to, and never follows a symlink at `path`."""
    path = Path(path)
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{folder}: not a private folder of this user: cannot keep the admin key there "
            f"(choose another with --admin-key-file or ${KEY_FILE_ENV})"
        )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    return path


def read_key_file(path: Path) -> str:
    return Path(path).read_text().strip()

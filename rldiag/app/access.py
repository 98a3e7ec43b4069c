"""Who may open what in the app: loopback or shared serving, the access token, the runs it serves.

Imported without Streamlit (the CLI and the tests use it). Two ways of serving:

- **loopback** (``127.0.0.0/8``, ``::1``, ``localhost``): only this machine can reach the port. Any
  path typed in the run box opens, as in a notebook. A token is still asked for when one is set
  (``rldiag app`` always sets one, as Jupyter does: other local users are others too).
- **shared** (any other address: ``0.0.0.0``, ``::``, a host name, a LAN address; also no address
  at all under ``streamlit run``, which then listens on every interface): a token is required
  (without one the app serves no run data and says how to set one); only the runs named on the
  command line (``$RLDIAG_RUN``) and the runs under the ``--root`` directories open, their real
  paths compared (a link out of a root is refused); nothing is written into a run (every run is
  mirrored: :func:`read_only_env`).

The token travels as ``?token=T`` in the printed URL and is compared with
:func:`hmac.compare_digest`; once given it holds for the browser session (page links drop the
URL's query parameters).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rldiag.io.run_layout import HOME_VAR, READ_ONLY_VAR

#: the access token (``rldiag app`` sets it in its own process; ``streamlit run`` reads it too)
TOKEN_VAR = "RLDIAG_APP_TOKEN"
#: the directories whose runs a shared app may open (``os.pathsep``-separated; ``rldiag app --root``)
ROOTS_VAR = "RLDIAG_APP_ROOTS"
#: the URL's query parameter that carries the token
TOKEN_PARAM = "token"
LOOPBACK_NAMES = ("localhost",)


def is_loopback(address: str | None) -> bool:
    """Whether a server bound to ``address`` is reachable from this machine only:
    ``127.0.0.0/8``, ``::1`` or ``localhost``. ``None``/empty (every interface), ``0.0.0.0``,
    ``::`` and any other host name are not."""
    text = (address or "").strip().strip("[]").lower()
    if not text:
        return False
    if text in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    """A fresh random token (URL-safe, 192 bits)."""
    return secrets.token_urlsafe(24)


def token_matches(given: str | None, token: str) -> bool:
    """``given`` equals ``token``, compared in constant time."""
    if not given:
        return False
    return hmac.compare_digest(str(given).encode("utf-8"), token.encode("utf-8"))


def url_with_token(url: str, token: str | None) -> str:
    """``url`` with ``?token=T`` (the printed address); unchanged without a token."""
    if not token:
        return url
    return f"{url.rstrip('/')}/?{TOKEN_PARAM}={token}"


def split_paths(text: str | None) -> list[str]:
    return [p for p in (text or "").split(os.pathsep) if p.strip()]


def real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.expanduser(str(path)))


def _within(path: str, base: str) -> bool:
    base = base.rstrip("/") or "/"
    return path == base or path.startswith(base if base.endswith("/") else base + "/")


@dataclass(frozen=True)
class Access:
    """The app's serving policy. ``runs``, ``roots``: real paths."""

    address: str | None
    token: str | None
    runs: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()

    @property
    def shared(self) -> bool:
        return not is_loopback(self.address)

    @property
    def where(self) -> str:
        return self.address or "every interface"

    def allows(self, path: str | os.PathLike) -> bool:
        """Whether the run at ``path`` may be opened: any path on loopback; in shared mode a
        named run or one under a root (real paths: a link out of a root is refused)."""
        if not self.shared:
            return True
        text = str(path).strip()
        if not text or "://" in text:
            return False
        p = real(text)
        return p in self.runs or any(_within(p, r) for r in self.roots)

    def refusal(self, path: str) -> str:
        """Why ``path`` is not opened (it names the path as given, nothing else of the server)."""
        roots = " and the runs under its --root directories" if self.roots else ""
        return (f"{path}: this app is shared (served on {self.where}), so it opens only the runs it was started "
                f"with{roots}; this path is not one of them.")

    def served_runs(self, limit: int = 50) -> list[str]:
        """What a shared app's picker lists: the named runs, then the run directories directly
        under each root (those with batch files)."""
        from rldiag.viz.runs import has_batches

        out = list(self.runs)
        for root in self.roots:
            try:
                children = sorted(p for p in Path(root).iterdir() if p.is_dir())
            except OSError:
                continue
            out += [str(p) for p in children if self.allows(p) and has_batches(p)]
        return list(dict.fromkeys(out))[:limit]


def access_from(address: str | None, runs: Sequence[str], env: Mapping[str, str] | None = None) -> Access:
    """The policy of an app bound to ``address`` serving ``runs`` (the command line's), with the
    token and roots of the environment."""
    environ: Mapping[str, str] = os.environ if env is None else env
    token = (environ.get(TOKEN_VAR) or "").strip() or None
    return Access(address=address, token=token, runs=tuple(dict.fromkeys(real(r) for r in runs)),
                  roots=tuple(dict.fromkeys(real(r) for r in split_paths(environ.get(ROOTS_VAR)))))


def read_only_env(env: Mapping[str, str] | None = None) -> str:
    """``$RLDIAG_READ_ONLY`` with every local path declared read-only (``/``): a shared app
    writes what it computes to the runs' mirrors under ``$RLDIAG_HOME``, never into a run."""
    environ: Mapping[str, str] = os.environ if env is None else env
    entries = split_paths(environ.get(READ_ONLY_VAR))
    return os.pathsep.join(entries if "/" in entries else [*entries, "/"])


def make_read_only() -> None:
    """Apply :func:`read_only_env` to this process (a shared app, before any run is opened)."""
    os.environ[READ_ONLY_VAR] = read_only_env()


NO_TOKEN = (f"This app is served on a non-loopback address, where anyone who can reach the port could read the "
            f"runs, and no access token is set, so it serves no run data. Set one: `rldiag app --address ADDRESS "
            f"--token T RUN` (or let `rldiag app` generate one), or `{TOKEN_VAR}=T streamlit run ...`; then open "
            f"the URL with `?{TOKEN_PARAM}=T`.")

ASK_TOKEN = ("This app asks for an access token. Open the URL `rldiag app` printed (it ends in "
             f"`?{TOKEN_PARAM}=...`), or type the token below.")


SHARED_HOW_TO = """No run is open. This app is shared: it opens the runs it was started with (listed below) and
the runs under its `--root` directories (type the path of one below)."""


def shared_note(acc: Access) -> str:
    roots = " and the runs under its --root directories" if acc.roots else ""
    return (f"Shared mode (served on {acc.where}): only the runs this app was started with{roots} open. Nothing "
            f"is written into a run: the baseline and what-ifs go to the run's mirror under ${HOME_VAR}.")

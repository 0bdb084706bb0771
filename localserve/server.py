"""Run the HTTP server: start-up checks and warnings, then uvicorn with a graceful drain.

First Ctrl-C / SIGTERM: stop admitting (new requests get 503), let running requests finish
for up to --drain-timeout, end whatever is left with an error event, then exit. A second
Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import uvicorn

from localserve.api.app import create_app
from localserve.api.auth import KeyChecker
from localserve.api.cors import origin_warnings
from localserve.common.net import (is_loopback, is_unix_socket, lan_address, listen_addresses,
                                  local_only)
from localserve.listen import bind_all, remove_unix_sockets
from localserve.common.config import Settings, SettingsError
from localserve.api.connections import (connection_cap, guarded_protocol, install_loop_error_throttle,
                                        raise_open_files_limit)
from localserve.common.private_state import private_dir
from localserve.office.quotas import QuotaKeeper
from localserve.settings_loader import from_toml
from localserve.models.registry import ModelRegistry
from localserve.office.office import Office

log = logging.getLogger("localserve")


def exposure_warning(settings: Settings, keys_loaded: int) -> str | None:
    """Based on the keys actually loaded, not on whether a key option was given."""
    if local_only(settings.host) or keys_loaded:
        return None
    return (f"\n{'!' * 78}\n"
            f"  localserve is listening on {settings.host}:{settings.port} WITHOUT an API key.\n"
            f"  Anyone who can reach this machine can use the model, read /slots and /metrics,\n"
            f"  and keep it busy. Exposed local LLM servers are routinely found and abused.\n"
            f"  Set a key:  localserve up --host {settings.host} --api-key YOUR-LONG-SECRET\n"
            f"  (or --api-key-file keys.txt with one 'name:key' per line)\n"
            f"{'!' * 78}")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, models: ModelRegistry):
        super().__init__(config)
        self.models, self.office = models, models.office
        self.exit_code = 0

    async def on_tick(self, counter: int) -> bool:
        """A model that fails to load at start-up ends the process (exit 2), in one line."""
        load_error = self.models.primary.load_error
        if load_error and not self.exit_code:
            log.error("stopping: the model could not be loaded (%s)", load_error)
            self.exit_code = 2
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets=None) -> None:
        """Serving, and out of open files the guarded protocol sheds its slowest connections."""
        await super().startup(sockets)
        install_loop_error_throttle(asyncio.get_running_loop(), self.config.http.shed_slowest)

    def handle_exit(self, sig, frame) -> None:
        if self.office.draining:
            # Not uvicorn's force_exit: that cancels the open streams mid-write and prints
            # their CancelledError tracebacks. Ending the requests lets each stream close
            # with an error event, and the process exits within a step.
            log.warning("second signal: exiting now, ending %d unfinished requests with an error",
                        self.models.in_flight())
            self.models.stop_engines()
            self.should_exit = True
            return
        # Draining before the log line: a second signal can run inside this handler (Python
        # runs handlers between bytecodes), and must find the drain already begun.
        self.office.draining = True
        timeout = self.office.settings.drain_timeout
        log.warning("shutting down: refusing new requests, letting %d running/queued ones finish "
                    "(up to %.0f s; press Ctrl-C again to exit now)", self.models.in_flight(),
                    timeout)
        threading.Thread(target=self._drain_then_exit, args=(timeout,), daemon=True).start()

    def _drain_then_exit(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.models.in_flight():
            time.sleep(0.05)
        left = self.models.in_flight()
        if left:
            log.warning("drain timeout: ending %d unfinished requests with an error", left)
        self.models.stop_engines()  # unfinished requests get an error event, not silence
        time.sleep(0.3)  # let those events reach their clients
        self.should_exit = True


# A SIGHUP may land while an editor is still saving the key file in place: it is looked at
# again this long after each reload, and read again if it changed meanwhile.
KEY_FILE_SETTLE_S = 2.0


def reload_keys(app, models: ModelRegistry, follow_up: bool = True) -> None:
    """SIGHUP: read the key file again and swap the key checker in one assignment, so
    requests in flight are untouched (Office.reload_keys audits the changes), and forget what
    removed keys cached; then the quotas from --config. A file that cannot be read, or yields
    no key, keeps the old keys (fail closed); a config file that cannot be read keeps the old
    quotas. A save still in progress when it was read is read again once it has changed
    (KEY_FILE_SETTLE_S), so half a file never locks the other half out until the next SIGHUP."""
    office = models.office
    if follow_up:
        stamp = _file_stamp(office.settings.api_key_file)
        timer = threading.Timer(KEY_FILE_SETTLE_S, _reload_if_changed, (app, models, stamp))
        timer.daemon = True
        timer.start()
    try:
        _, removed = office.reload_keys()
    except SettingsError as exc:
        log.error("SIGHUP: keeping the current keys: %s", exc)
    else:
        for name in removed:
            models.drop_scope(name)
        app.state.keys = KeyChecker(office.keys)
        log.info("SIGHUP: %d keys loaded", len(office.keys))
    reload_quotas(app, office.settings)


def _file_stamp(path: str | None) -> tuple | None:
    try:
        stat = os.stat(path) if path else None
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size) if stat else None


def _reload_if_changed(app, models: ModelRegistry, stamp: tuple | None) -> None:
    if _file_stamp(models.office.settings.api_key_file) != stamp:
        log.info("SIGHUP: the key file changed after it was read (a save in progress); "
                 "reading it again")
        reload_keys(app, models, follow_up=False)


def reload_quotas(app, settings: Settings) -> None:
    if not settings.config:
        return
    try:
        quotas = from_toml(settings.config).get("quotas", {})
    except SettingsError as exc:
        log.error("SIGHUP: keeping the current quotas: %s", exc)
        return
    keeper = app.state.quotas
    if keeper is None:
        app.state.quotas = keeper = QuotaKeeper({})
    for name in sorted(keeper.quotas.keys() | quotas.keys()):
        if keeper.quotas.get(name) != quotas.get(name):
            log.info("SIGHUP: quota [%s] %s", name, quotas.get(name) or "removed")
    keeper.quotas = quotas  # one assignment: holds already taken stay counted


def check_gguf(path) -> None:
    """A GGUF file starts with the magic bytes 'GGUF'; say so plainly for anything else."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise SettingsError(f"-m {path}: not a GGUF model file (it starts with {magic!r}, a GGUF "
                            f"file with b'GGUF'); download a .gguf file, or convert the model "
                            f"with llama.cpp's convert_hf_to_gguf.py")


def check_state_dir(office: Office) -> None:
    """The ledger, conversations and disk cache need a writable state folder: say so, naming
    the folder and the flag, before the model loads (not as a model-loading error later)."""
    s = office.settings
    if not (s.ledger or s.web or s.cache_disk):
        return
    folder = office.state_dir()
    try:
        private_dir(folder)
        probe = folder / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise SettingsError(f"the state folder {folder} cannot be created or written "
                            f"({exc.strerror or exc}): give a writable one with --state-dir (or "
                            f"LOCALSERVE_STATE_DIR; under systemd, StateDirectory= sets "
                            f"$STATE_DIRECTORY), or run with --no-ledger --no-web") from None


def check_tls(settings: Settings) -> None:
    """The key and certificate load, or the start stops naming them (not uvicorn's trace)."""
    import ssl

    if settings.ssl_cert_file:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                settings.ssl_cert_file, settings.ssl_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(f"--ssl-cert-file {settings.ssl_cert_file} with --ssl-key-file "
                                f"{settings.ssl_key_file}: cannot be used "
                                f"({getattr(exc, 'strerror', None) or exc})") from None


def scheme(settings: Settings) -> str:
    return "https" if settings.ssl_cert_file else "http"


def say_what_runs(settings: Settings, office: Office) -> None:
    """One line each: where the page and the API are, who may use them, with what quotas,
    and where the state lives."""
    addresses = listen_addresses(settings.host)
    for address in addresses:
        where = f"{scheme(settings)}://{address}:{settings.port}/v1"
        log.info("listening on %s", f"unix:{address} (http://localhost/v1 through it)"
                 if is_unix_socket(address) else where)
    tcp = [a for a in addresses if not is_unix_socket(a)]
    everywhere = any(a in ("0.0.0.0", "::", "") for a in tcp)
    lan = lan_address() if everywhere else None
    if lan:
        log.info("for colleagues: %s://%s:%d/v1 (API) and %s://%s:%d/ (chat page)%s",
                 scheme(settings), lan, settings.port, scheme(settings), lan, settings.port,
                 "" if settings.ssl_cert_file else "; keys cross the network in clear text: "
                 "--ssl-key-file and --ssl-cert-file serve HTTPS")
    elif settings.web and tcp:
        host = "localhost" if is_loopback(tcp[0]) else tcp[0]
        log.info("chat page: %s://%s:%d/%s", scheme(settings), host, settings.port,
                 " (for colleagues: this machine's address)" if everywhere else "")
    holders = list(office.keys.values())
    if holders:
        admins = sorted(h.name for h in holders if h.role == "admin")
        log.info("keys: %d loaded, %d admin%s%s", len(holders), len(admins),
                 "" if len(admins) == 1 else "s", f" ({', '.join(admins)})" if admins else "")
    for holder in holders:
        if holder.models is not None:
            log.info("key %s may use only: %s", holder.name, ", ".join(sorted(holder.models)))
    for name in settings.trusted_frontends:
        log.info("trusted frontend: %s (its requests are billed to the colleague its "
                 "X-OpenWebUI-User-* headers name)", name)
    for name, quota in sorted(settings.quotas.items()):
        limits = ", ".join(f"{k} {v:g}" for k, v in vars(quota).items() if v is not None)
        log.info("quota [%s]: %s", name, limits)
    for name in office.unknown_names() if office.keys_enabled else ():
        log.warning("%s names no key in the key file: it applies to nobody (misspelt?)", name)
    if settings.ledger or settings.web or settings.cache_disk:
        log.info("state folder: %s", office.state_dir().resolve())


def unserved_key_models(models: ModelRegistry) -> list[str]:
    """A key file's models= names that no served model is called (a misspelt name would keep
    the colleague off the model meant for them, silently)."""
    served = {name for e in models.entries.values()
              for name in (e.spec.name, *e.host.settings.aliases)}
    return [f"--api-key-file: {holder.name}'s models= names '{name}', which no served model is "
            f"called (served: {', '.join(models.entries)})"
            for holder in models.office.keys.values() for name in sorted(holder.models or ())
            if name not in served]


def serve(settings: Settings, log_level: str = "info", plain_uvicorn_logs: bool = True) -> int:
    try:
        models = ModelRegistry.from_settings(settings)
    except SettingsError as exc:
        log.error("%s", exc)
        return 2
    default_host, office = models.primary, models.office
    try:
        warning = exposure_warning(settings, len(office.keys))  # reads --api-key-file now
        if warning:
            log.warning(warning)
        for problem in origin_warnings(settings.cors_origins):
            log.warning(problem)
        for entry in models.entries.values():
            check_gguf(entry.host.model_file)
        for problem in unserved_key_models(models):
            log.warning(problem)
        if settings.memory_check:
            log.info(default_host.check_memory(str(default_host.model_file)))
        if models.several:
            log.info("models: %s (the first is the default; the others load on demand)",
                     ", ".join(models.entries))
        check_state_dir(office)
        check_tls(settings)
        sockets = bind_all(settings.host, settings.port)
    except SettingsError as exc:
        log.error("%s", exc)
        return 2
    app = create_app(settings, models=models)
    open_files = raise_open_files_limit()
    protocol = guarded_protocol(settings.header_timeout, settings.body_timeout,
                                connection_cap(settings.max_connections, open_files))
    config = uvicorn.Config(app, log_level=log_level,
                            ssl_keyfile=settings.ssl_key_file, ssl_certfile=settings.ssl_cert_file,
                            timeout_graceful_shutdown=5, http=protocol,
                            loop="asyncio",  # the connection guard is asyncio's (connections.py)
                            **({} if plain_uvicorn_logs else {"log_config": None}))
    say_what_runs(settings, office)
    if office.keys_enabled and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: reload_keys(app, models))
    server = DrainingServer(config, models)
    try:
        server.run(sockets=sockets)
    finally:
        remove_unix_sockets(settings.host)
    return server.exit_code

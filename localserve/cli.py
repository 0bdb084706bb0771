"""`localserve up` and friends. Flags use llama-server's spelling where one exists."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
import sys

from localserve import __version__, rpc_worker
from localserve.common.config import Settings, SettingsError
from localserve.options import add_settings_flags


def _up_parser(sub) -> None:
    up = sub.add_parser("up", help="serve a GGUF model over an OpenAI-compatible API",
                        argument_default=argparse.SUPPRESS,
                        description="Start the server. With no -m it serves the embedded "
                                    "SmolLM2-135M-Instruct model. Settings come from these flags, "
                                    "then LOCALSERVE_<NAME> environment variables (e.g. "
                                    "LOCALSERVE_CTX_SIZE=16384), then a TOML file (--config), "
                                    "then the defaults shown.")
    up.add_argument("--config", help="TOML file of settings (keys as in the flags, e.g. ctx_size = 16384)")
    add_settings_flags(up)
    life = up.add_argument_group("logging")
    life.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    life.add_argument("--log-format", default="text", choices=["text", "json"],
                      help="json: one JSON object per line (time, level, logger, message), "
                           "for journald/Loki/ELK")
    up.add_argument("--version", action="version", version=f"localserve {__version__}")
    same = up.add_argument_group("llama-server's flags for what localserve always does "
                                 "(accepted, so that its command lines start localserve too)")
    for flags, why in NO_OP_FLAGS.items():
        same.add_argument(*flags, dest="no_op_flags", action="append_const", const=flags[-1],
                          help=why)


# llama-server flags that turn on what localserve always does: taken, changing nothing, and
# said so in one log line at start-up.
NO_OP_FLAGS = {
    ("-kvu", "--kv-unified"): "the slots share one cache pool unless --no-kv-unified",
    ("-cb", "--cont-batching"): "batching is always continuous",
    ("--jinja",): "chat templates are always rendered with Jinja",
    ("--metrics",): "/metrics is always served",
    ("--slots",): "/slots is always served",
}


def no_op_note(given: list[str]) -> str:
    """The start-up line for the no-op flags given."""
    why = {flags[-1]: reason for flags, reason in NO_OP_FLAGS.items()}
    return "; ".join(f"{flag}: nothing to change ({why[flag]})" for flag in dict.fromkeys(given))


def _bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure throughput and latency against a running server",
                           description="Send a seeded, mixed, streaming workload at each "
                                       "concurrency level to any OpenAI-compatible server; print a "
                                       "table, name the knee, write JSON and a PNG plot.")
    bench.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    bench.add_argument("--api-key", help="API key, if the server requires one")
    bench.add_argument("--model", help="model id to send (default: none)")
    bench.add_argument("--concurrency", default="1,4,16,32,64",
                       help="comma-separated levels (default 1,4,16,32,64)")
    bench.add_argument("--requests", type=int, default=64, help="requests per level (default 64; "
                       "doc, office: colleagues, at most 24; longdoc: 16; copy: passages, at most 8)")
    bench.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    bench.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    bench.add_argument("--workload", choices=["mixed", "doc", "longdoc", "office", "agents", "copy"],
                       default="mixed",
                       help="mixed: the seeded chat workload per level (default); doc: colleagues "
                            "chatting with their documents (prompt tokens reused, follow-up "
                            "time to first token); longdoc: the same, 16 colleagues with ~1,800-token "
                            "documents; office: 24 colleagues on one ~400-word system "
                            "prompt, 4 turns each, 8 at a time; agents: 4 colleagues on one coding agent's "
                            "~5,000-token system prompt, 4 turns each; copy: answers that copy text, per level "
                            "(drafted tokens, the share kept, tokens per step)")


def _top_parser(sub) -> None:
    from tui.app import build_parser as build_top_parser

    top = sub.add_parser("top", help="live terminal dashboard of a running server",
                         description="Slot occupancy, queue, throughput and the server machine, live.")
    build_top_parser(top)


def run_models(_: argparse.Namespace) -> int:
    from localserve.common.config import MODELS_DIR, available_models

    from localserve.models.pull import recommended_table

    models = available_models()
    for name, path in models:
        # a projector (mmproj) is no model: it lets one read images (--mmproj)
        kind = "  projector: --mmproj " + name if name.startswith("mmproj") else f"  {name}"
        print(f"{path.stat().st_size / 2**20:8.1f} MiB{kind}  ({path})")
    if not models:
        print(f"no models: put .gguf files in {MODELS_DIR}, or run scripts/setup for the default")
    print(f"\nRecommended for an office (`localserve pull NAME` puts one in {MODELS_DIR}):\n")
    print(recommended_table())
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from pathlib import Path

    from localserve.common.config import MODELS_DIR
    from localserve.models.pull import PullError, projector_of, pull

    folder, projector = Path(args.dir) if args.dir else MODELS_DIR, projector_of(args.name)
    try:
        path = pull(args.name, folder, args.sha256, max_bytes=int(args.max_gb * 10**9))
        if projector:  # what lets it read images, beside it
            projector = pull(projector, folder, max_bytes=int(args.max_gb * 10**9))
    except PullError as exc:
        print(f"localserve pull: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nlocalserve pull: stopped; run it again to continue the download", file=sys.stderr)
        return 130
    print(f"serve it: localserve up -m {path.name}"
          + (f" --mmproj {projector.name}" if projector else ""))
    return 0


class Parser(argparse.ArgumentParser):
    """argparse that suggests the closest flag for a misspelt one."""

    def error(self, message: str):
        unknown = re.findall(r"(--?[\w-]+)", message.split(":", 1)[-1]) if "unrecognized" in message else []
        known = [o for action in self._all_actions() for o in action.option_strings]
        for flag in unknown:
            close = difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]}?)"
        # one line that says what is wrong and where the flags are, not 40 lines of usage
        self.exit(2, f"{self.prog}: error: {message}\n(every flag: {self.prog} --help)\n")

    def _all_actions(self):
        yield from self._actions
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from sub._actions


class JsonLogFormatter(logging.Formatter):
    """--log-format json: one object per line, uvicorn's access lines included."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _usage_parser(sub) -> None:
    usage = sub.add_parser("usage", help="token usage per key, day or model, from the ledger",
                           description="Reads <state-dir>/ledger.db directly: no server needed.")
    usage.add_argument("--since", default="7d", help="how far back: 7d, 24h, 30m, or a date "
                                                      "(default 7d)")
    usage.add_argument("--by", default="key", choices=["key", "day", "model"])
    usage.add_argument("--state-dir", help="where ledger.db is (default ~/.local/share/localserve, "
                                           "or LOCALSERVE_STATE_DIR)")
    usage.add_argument("--audit", action="store_true",
                       help="the audit log instead: 401s, quota refusals, key changes")


def since_seconds(text: str) -> float:
    """'7d', '24h', '30m' -> a unix time that long ago; an ISO date -> that date."""
    import time
    from datetime import datetime

    units = {"d": 86400, "h": 3600, "m": 60}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(text[:-1]) * units[text[-1]]
    return datetime.fromisoformat(text).timestamp()


def run_usage(args: argparse.Namespace) -> int:
    import os
    import time
    from pathlib import Path

    from localserve.office.ledger import audit_log, default_state_dir, usage

    folder = args.state_dir or os.environ.get("LOCALSERVE_STATE_DIR")
    path = (Path(folder) if folder else default_state_dir()) / "ledger.db"
    print(f"ledger: {path}", file=sys.stderr)  # which server's rows these are
    try:
        since = since_seconds(args.since)
    except ValueError:
        print(f"localserve usage: --since {args.since}: use 7d, 24h, 30m or a date", file=sys.stderr)
        return 2
    if not path.is_file():
        print(f"no ledger at {path} (start the server once, or pass --state-dir)", file=sys.stderr)
        return 1
    if args.audit:
        for row in audit_log(path, since):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["ts"]))
            print(f"{stamp}  {row['event']:<14} {row['key'] or '-':<12} {row['detail']}")
        return 0
    rows = usage(path, since, None, args.by)
    wide = max([20, *(len(str(r[args.by])) for r in rows)])  # colleagues' e-mail names align
    print(f"{args.by:<{wide}} {'requests':>9} {'refused':>8} {'prompt':>10} {'cached':>10} "
          f"{'completion':>11}")
    for r in rows:
        print(f"{str(r[args.by]):<{wide}} {r['requests']:>9} {r['refused']:>8} "
              f"{r['prompt_tokens']:>10} {r['cached_tokens']:>10} {r['completion_tokens']:>11}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="localserve", description="A local LLM server.")
    parser.add_argument("--version", action="version", version=f"localserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _up_parser(sub)
    sub.add_parser("models", help="list the GGUF files -m can name (models/ and the default), "
                   "and the models recommended for an office")
    pulling = sub.add_parser("pull", help="download a recommended model (or OWNER/REPO/FILE.gguf) "
                             "into models/, resumable and checked")
    pulling.add_argument("name", help="a name from `localserve models`, or OWNER/REPO/FILE.gguf")
    pulling.add_argument("--sha256", help="the file's expected sha256, when the hub gives none")
    pulling.add_argument("--dir", help="where to put it (default: models/)")
    pulling.add_argument("--max-gb", type=float, default=100.0,
                         help="the most a file of no announced size may be (default 100)")
    _top_parser(sub)
    _bench_parser(sub)
    _usage_parser(sub)
    rpc_worker.add_parser(sub)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os

    from localserve.bench import load as bench, report as bench_report

    args.url = args.url.rstrip("/").removesuffix("/v1")  # the bench adds /v1 itself
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if args.workload != "mixed":
        from localserve.bench import office as office_bench

        os.makedirs(args.out, exist_ok=True)
        out = office_bench.run(args.url, args.workload, levels, args.seed, args.api_key,
                               args.requests)
        with open(os.path.join(args.out, f"bench-{args.workload}.json"), "w") as fh:
            json.dump({"url": args.url, "seed": args.seed, "results": out}, fh, indent=1)
        return 0
    jobs = bench.make_workload(args.requests, args.seed)
    summaries = []
    for level in levels:
        def progress(done, total, level=level):
            bar = "#" * (30 * done // total)
            print(f"\rconcurrency {level:>3} [{bar:<30}] {done}/{total}", end="", file=sys.stderr,
                  flush=True)

        summaries.append(asyncio.run(bench.run_level(args.url, jobs, level, args.model, progress,
                                                     api_key=args.api_key)))
        print(file=sys.stderr)
    print(bench.HEADER)
    for summary in summaries:
        print(summary.row())
    knee, reason = bench_report.find_knee(summaries)
    print(f"\noperating limit: {'concurrency ' + str(knee) if knee else 'not reached'}: {reason}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as fh:
        fh.write(bench.summary_json(summaries, url=args.url, seed=args.seed, requests=args.requests,
                                    knee=knee, knee_reason=reason))
    bench_report.plot(summaries, os.path.join(args.out, "bench.png"), f"localserve bench: {args.url}")
    print(f"wrote {args.out}/bench.json and {args.out}/bench.png")
    return 0 if all(s.errors == 0 for s in summaries) else 1


def settings_from_args(args: argparse.Namespace) -> Settings:
    from localserve.settings_loader import load_settings

    from localserve.models.model_specs import split_model_flags

    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "config", "log_level", "log_format", "no_op_flags")}
    if "model" in given:
        default, named = split_model_flags(given.pop("model"))
        if default is not None:
            given["model"] = default
        if named:
            given["models"] = named
    return load_settings(given, config_path=getattr(args, "config", None))


def run_up(args: argparse.Namespace) -> int:
    from localserve.server import serve

    log_level = getattr(args, "log_level", "info")
    json_logs = getattr(args, "log_format", "text") == "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if json_logs else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"localserve: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "no_op_flags", None):
        logging.getLogger("localserve").info("%s", no_op_note(args.no_op_flags))
    if getattr(args, "api_keys", None):
        logging.getLogger("localserve").warning(
            "--api-key on the command line is visible to every user of this machine (ps); prefer "
            "--api-key-file (chmod 600) or the LOCALSERVE_API_KEYS environment variable")
    return serve(settings, log_level, plain_uvicorn_logs=not json_logs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "up":
        return run_up(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "models":
        return run_models(args)
    if args.command == "pull":
        return run_pull(args)
    if args.command == "usage":
        return run_usage(args)
    if args.command == "rpc-worker":
        return rpc_worker.run(args)
    if args.command == "top":
        from tui.app import run as run_top

        try:
            return run_top(args)
        except SettingsError as exc:  # e.g. --api-key-file that cannot be read
            print(f"localserve top: {exc}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())

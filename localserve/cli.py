"""`localserve up` and friends. Flags use llama-server's spelling where one exists."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
import sys

from localserve import __version__, rpc_worker
from localserve.config import (CACHE_TYPES, FLASH_ATTN, REASONING_FORMATS, SCHEDULERS, SPEC_TYPES,
                               Settings, SettingsError)


def _up_parser(sub) -> None:
    up = sub.add_parser("up", help="serve a GGUF model over an OpenAI-compatible API",
                        argument_default=argparse.SUPPRESS,
                        description="Start the server. With no -m it serves the embedded "
                                    "SmolLM2-135M-Instruct model. Settings come from these flags, "
                                    "then LOCALSERVE_<NAME> environment variables (e.g. "
                                    "LOCALSERVE_CTX_SIZE=16384), then a TOML file (--config), "
                                    "then the defaults shown.")
    up.add_argument("--config", help="TOML file of settings (keys as in the flags, e.g. ctx_size = 16384)")
    model = up.add_argument_group("model")
    model.add_argument("-m", "--model", action="append",
                       help="path to a .gguf file, or a file name inside models/; repeat as "
                            "--model NAME=PATH to serve several models, chosen by `model`")
    model.add_argument("--models-dir", dest="models_dir",
                       help="serve every .gguf in this folder too, named by file stem")
    model.add_argument("--max-loaded-models", dest="max_loaded_models", type=int,
                       help="models loaded at once; others load on demand (default: as memory allows)")
    model.add_argument("--idle-unload", dest="idle_unload", type=float,
                       help="unload a model idle this many seconds (default 0: never)")
    model.add_argument("--model-switch-timeout", dest="model_switch_timeout", type=float,
                       help="seconds a request for another model waits for the loaded one's "
                            "requests before a 503 (default 60); the loaded model keeps serving")
    model.add_argument("--memory-budget", dest="memory_budget",
                       help="cap on the loaded models' memory, e.g. 6G (default: free memory)")
    model.add_argument("--alias", dest="model_alias", help="model id to report in /v1/models")
    model.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                       help="load even if the model and cache look larger than free memory")
    gpu = up.add_argument_group("GPU offload (CUDA or Metal builds)")
    gpu.add_argument("-ngl", "--n-gpu-layers", dest="n_gpu_layers", type=int,
                     help="layers to offload (default: all when the build can offload, else 0)")
    gpu.add_argument("--main-gpu", dest="main_gpu", type=int, help="GPU for the model (default 0)")
    gpu.add_argument("--tensor-split", dest="tensor_split",
                     help="share of the model per GPU, e.g. 3,1")
    gpu.add_argument("--rpc", dest="rpc_servers",
                     help="llama.cpp RPC workers (localserve rpc-worker) as devices, e.g. "
                          "10.0.0.2:50052,10.0.0.3:50052; -ngl layers go to them (RPC builds only)")
    gpu.add_argument("-t", "--threads", type=int, help="CPU threads (default: all cores)")
    sched = up.add_argument_group("slots and scheduling")
    sched.add_argument("-c", "--ctx-size", dest="ctx_size", type=int,
                       help="total context, split evenly over the slots (default 8192)")
    sched.add_argument("-np", "--parallel", type=int,
                       help="slots = requests decoded together; each gets ctx-size/parallel tokens "
                            "(default 4)")
    sched.add_argument("--max-num-batched-tokens", type=int,
                       help="tokens per engine step: small = smooth streams while long prompts "
                            "arrive, large = faster prefill (default 256 on CPU, 512 with -ngl)")
    sched.add_argument("--prefill-batch-tokens", type=int,
                       help="tokens per step while no stream is decoding (default: 4x "
                            "--max-num-batched-tokens)")
    sched.add_argument("--max-num-seqs", type=int, help="cap on concurrent sequences (default: slots)")
    sched.add_argument("--scheduler", choices=SCHEDULERS,
                       help="continuous (default, the product); static and serial exist to be "
                            "measured against (see localserve bench)")
    sched.add_argument("--kv-unified", action="store_true",
                       help="one cache pool of -c tokens shared by all slots instead of a fixed "
                            "share each; when it runs short, the newest sequence is preempted")
    sched.add_argument("-cram", "--cache-ram", dest="cache_ram", type=int,
                       help="MiB of RAM for prompts kept beyond the slots, restored instead of "
                            "recomputed when their conversation comes back (default 8192, at "
                            "most a quarter of free RAM; 0 turns it off)")
    sched.add_argument("--cache-disk", type=int,
                       help="MiB of files under --state-dir for prompts the RAM cache evicts and "
                            "for all of them at shutdown, so conversations survive a restart "
                            "(default 0: off; the files hold prompts' state: mode 600)")
    sched.add_argument("--spec", choices=SPEC_TYPES,
                       help="speculative decoding: ngram drafts each answer's next tokens from "
                            "its own prompt and output (no draft model; output unchanged; faster "
                            "on answers that copy text), off (default)")
    sched.add_argument("--spec-type", dest="spec", choices=SPEC_TYPES,
                       type=lambda v: {"ngram-mod": "ngram", "ngram-simple": "ngram",
                                       "none": "off"}.get(v, v),
                       help="llama-server's spelling of --spec (ngram-mod, ngram-simple, none)")
    sched.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", choices=CACHE_TYPES,
                       help="cache type for K (default f16); q8_0 fits ~1.9x the tokens")
    sched.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", choices=CACHE_TYPES,
                       help="cache type for V (default f16); a quantized V needs --flash-attn on")
    sched.add_argument("-fa", "--flash-attn", dest="flash_attn", choices=FLASH_ATTN,
                       help="flash attention (default auto)")
    sched.add_argument("--max-queue", type=int,
                       help="waiting requests beyond this get HTTP 503 + Retry-After (default 64)")
    sched.add_argument("--queue-timeout", type=float,
                       help="seconds a request may wait for a slot before it gets 503 (default: none)")
    sampling = up.add_argument_group("defaults for requests that leave them out (llama-server's flags)")
    sampling.add_argument("--temp", type=float, help="temperature (default 1.0, as OpenAI)")
    sampling.add_argument("--top-k", type=int, help="top-k (default 0: off)")
    sampling.add_argument("--top-p", type=float, help="top-p (default 1.0: off)")
    sampling.add_argument("-s", "--seed", type=int, help="seed (default: random per request)")
    sampling.add_argument("-n", "--n-predict", type=lambda v: None if int(v) < 0 else int(v),
                          help="max_tokens (default -1: until the slot is full)")
    sampling.add_argument("--chat-template",
                          help="the default model's chat template instead of its GGUF's: chatml, "
                               "llama3, gemma, or a Jinja template")
    sampling.add_argument("--chat-template-file", help="the same, read from a Jinja file")
    sampling.add_argument("--reasoning-format", choices=REASONING_FORMATS,
                          help="a <think> block at the start of an answer goes to "
                               "reasoning_content: auto (when the chat template writes them; "
                               "default), deepseek (always), none (left in the text)")
    net = up.add_argument_group("network and access")
    net.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 = the LAN)")
    net.add_argument("--port", type=int, help="port (default 8080)")
    net.add_argument("--api-key", dest="api_keys", action="append",
                     help="require this key (repeatable); clients send 'Authorization: Bearer KEY'")
    net.add_argument("--api-key-file", help="file of 'name:key' lines; the name identifies the user")
    net.add_argument("--cors-origin", dest="cors_origins", action="append",
                     help="allow browser frontends on this origin (repeatable), e.g. http://chat.lan:3000")
    net.add_argument("--allowed-host", dest="allowed_hosts", action="append",
                     help="a Host name to accept besides loopback names (repeatable); only matters "
                          "on a loopback server without keys, where other Hosts are refused "
                          "(DNS-rebinding guard)")
    net.add_argument("--max-body-bytes", type=int, help="largest request body (default 4 MiB)")
    net.add_argument("--header-timeout", type=float,
                     help="seconds a client may take to send its request headers (default 10)")
    net.add_argument("--body-timeout", type=float,
                     help="seconds a client may take to send a request body once its headers "
                          "are in (default 60)")
    net.add_argument("--max-connections", type=int,
                     help="open connections at most; at the cap the slowest header-sender is "
                          "dropped (default 1000)")
    share = up.add_argument_group("sharing between API keys (apply only when keys are set)")
    share.add_argument("--shared-prefix-cache", action="store_true",
                       help="let keys reuse each other's cached prompt prefixes (faster for a common "
                            "system prompt, but one key can then probe what another sent)")
    share.add_argument("--max-queue-per-key", type=int,
                       help="waiting requests one key may hold; more get 429 (default: half of "
                            "--max-queue)")
    share.add_argument("--max-slots-per-key", type=int,
                       help="slots one key may hold while another key waits (default: all but one)")
    share.add_argument("--rate-limit", type=float,
                       help="requests per second per key, beyond the burst 429 + Retry-After "
                            "(default 10; 0 = off)")
    share.add_argument("--rate-burst", type=int,
                       help="requests a key may send at once before --rate-limit applies (default 40)")
    life = up.add_argument_group("lifecycle")
    life.add_argument("--drain-timeout", type=float,
                      help="on Ctrl-C/SIGTERM, seconds to let running requests finish (default 30); "
                           "a second Ctrl-C exits at once")
    life.add_argument("--state-dir", help="where the ledger (ledger.db) lives "
                                          "(default ~/.local/share/localserve)")
    life.add_argument("--no-ledger", dest="ledger", action="store_false",
                      help="keep no per-request usage")
    life.add_argument("--no-web", dest="web", action="store_false",
                      help="no chat page at / (the API and the dashboard are unchanged)")
    life.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    life.add_argument("--log-format", default="text", choices=["text", "json"],
                      help="json: one JSON object per line (time, level, logger, message), "
                           "for journald/Loki/ELK")
    up.add_argument("--version", action="version", version=f"localserve {__version__}")


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
    bench.add_argument("--requests", type=int, default=64, help="requests per level (default 64)")
    bench.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    bench.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")


def _top_parser(sub) -> None:
    from tui.app import build_parser as build_top_parser

    top = sub.add_parser("top", help="live terminal dashboard of a running server",
                         description="Slot occupancy, queue, throughput and the server machine, live.")
    build_top_parser(top)


def run_models(_: argparse.Namespace) -> int:
    from localserve.config import MODELS_DIR, available_models

    models = available_models()
    for name, path in models:
        print(f"{path.stat().st_size / 2**20:8.1f} MiB  {name}  ({path})")
    if not models:
        print(f"no models: put .gguf files in {MODELS_DIR}, or run scripts/setup for the default")
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
        super().error(message)

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

    from localserve.ledger import audit_log, default_state_dir, usage

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
    print(f"{args.by:<20} {'requests':>9} {'prompt':>10} {'cached':>10} {'completion':>11}")
    for r in rows:
        print(f"{str(r[args.by]):<20} {r['requests']:>9} {r['prompt_tokens']:>10} "
              f"{r['cached_tokens']:>10} {r['completion_tokens']:>11}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="localserve", description="A local LLM server.")
    parser.add_argument("--version", action="version", version=f"localserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _up_parser(sub)
    sub.add_parser("models", help="list the GGUF files -m can name (models/ and the default)")
    _top_parser(sub)
    _bench_parser(sub)
    _usage_parser(sub)
    rpc_worker.add_parser(sub)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from localserve import bench, bench_report

    args.url = args.url.rstrip("/").removesuffix("/v1")  # the bench adds /v1 itself
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
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

    from localserve.model_specs import split_model_flags

    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "config", "log_level", "log_format")}
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
    if args.command == "usage":
        return run_usage(args)
    if args.command == "rpc-worker":
        return rpc_worker.run(args)
    if args.command == "top":
        from tui.app import run as run_top

        return run_top(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

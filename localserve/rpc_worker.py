"""`localserve rpc-worker`: lend this machine's CPU and memory to a server on another machine
through llama.cpp's RPC backend (`localserve up --rpc HOST:PORT` there). Needs a build with
RPC (`LOCALSERVE_RPC=1 scripts/setup`). The protocol has no authentication and no encryption:
anyone who can reach the port can use (and crash) the worker."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from localserve.common.net import is_loopback

log = logging.getLogger("localserve.rpc")


def add_parser(sub) -> None:
    worker = sub.add_parser("rpc-worker", help="serve this machine's CPU to a localserve on "
                                               "another machine (llama.cpp RPC; trusted networks only)")
    worker.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; anything else is reachable "
                             "by anyone on that network: use a tunnel)")
    worker.add_argument("--port", type=int, default=50052)
    worker.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    worker.add_argument("--cache-dir", help="keep received weights here, so a restarted server "
                                            "sends them again faster (default: none)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from localserve.engine.runner.rpc import RpcUnavailable, serve_worker

    if not is_loopback(args.host):
        log.warning("!!! the RPC worker listens on %s:%d with NO authentication and NO encryption: "
                    "anyone who can reach this port can run code paths in it, read what it holds, "
                    "or crash it. Use it only on a trusted network, or bind 127.0.0.1 and reach it "
                    "through an SSH tunnel or WireGuard.", args.host, args.port)
    log.info("RPC worker on %s:%d with %d threads; Ctrl-C stops it", args.host, args.port,
             args.threads)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the C server never returns to Python
    try:
        serve_worker(args.host, args.port, args.threads, args.cache_dir)
    except RpcUnavailable as exc:
        print(f"localserve rpc-worker: {exc}", file=sys.stderr)
        return 2
    return 0

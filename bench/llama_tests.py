#!/usr/bin/env python3
"""llama.cpp's own server tests (`tools/server/tests` of the llama.cpp localserve runs) against
localserve and llama-server, offline: how many of each file pass on each side.

The tests start `LLAMA_SERVER_BIN_PATH` with llama-server's flags and a hub model. Here that is
this script (`--serve`), which starts localserve (or llama-server with --peer) on the embedded
model instead, with the project's random projector (`scripts/make-projector`) for the vision
tests, and drops the flags localserve does not take (each named below). A pytest plugin serves
the tests' two hub images from small local PNGs and skips the presets' downloads. What needs the
hub (an image the server itself fetches) or a real model's answer ("cat") fails on both sides.

    bench/run llama_tests [--files unit/test_vision_api.py unit/test_compat_oai_responses.py]
        [--llama-server "$(scripts/build-llama-server)"]

Needs pytest's `wget` and `filelock` (the tests import them): put in a folder with
`pip install --target FOLDER wget filelock` and pass `--deps FOLDER`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# llama-server flags these tests pass that localserve refuses (and why it may): a logical batch
# size and a pooling type (localserve sizes its steps and pools the last token itself), the
# legacy template engine, /slots turned off, an embeddings-only server
DROPPED = {"--batch-size": 1, "--pooling": 1, "--no-jinja": 0, "--no-slots": 0, "--embedding": 0}
HUB_FLAGS = {"--hf-repo": 1, "--hf-file": 1, "--model-url": 1, "--mmproj-url": 1, "--offline": 0}
PLUGIN = '''
import requests, utils
utils.ServerPreset.load_all = staticmethod(lambda: None)
_get, LOCAL = requests.get, {"11_truck.png": "%s", "91_cat.png": "%s"}
class _Local:
    status_code = 200
    def __init__(self, path): self.content = open(path, "rb").read()
    def raise_for_status(self): pass
def get(url, *args, **kwargs):
    for name, path in LOCAL.items():
        if isinstance(url, str) and url.startswith("https://huggingface.co") and url.endswith(name):
            return _Local(path)
    return _get(url, *args, **kwargs)
requests.get = get
'''


def serve(args: list[str]) -> None:
    """Be LLAMA_SERVER_BIN_PATH: the tests' flags, the hub's model replaced."""
    peer = os.environ.get("LLAMA_TESTS_PEER")
    drop = HUB_FLAGS if peer else {**HUB_FLAGS, **DROPPED}
    kept, i = [], 0
    while i < len(args):
        if args[i] in drop:
            i += 1 + drop[args[i]]
            continue
        kept.append(args[i])
        i += 1
    model = ["-m", os.environ["LLAMA_TESTS_MODEL"], "--mmproj", os.environ["LLAMA_TESTS_MMPROJ"]]
    program = [peer] if peer else [sys.executable, "-m", "localserve", "up"]
    os.execv(program[0], program + model + kept)


def run(files: list[str], tests: Path, env: dict) -> dict[str, tuple[int, int]]:
    """(passed, run) per file."""
    counts = {}
    for name in files:
        out = subprocess.run([sys.executable, "-m", "pytest", "-p", "llama_tests_plugin",
                              "-p", "no:cacheprovider", "-q", name], cwd=tests, env=env,
                             capture_output=True, text=True).stdout
        passed = int((re.search(r"(\d+) passed", out) or [0, 0])[1])
        failed = int((re.search(r"(\d+) failed", out) or [0, 0])[1])
        counts[name] = (passed, passed + failed)
    return counts


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=["unit/test_vision_api.py",
                                                       "unit/test_compat_oai_responses.py"])
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--deps", required=True, help="a folder holding wget and filelock")
    args = parser.parse_args()
    sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True,  # noqa: E731
                                     text=True).stdout.strip()
    src = Path(sh(str(ROOT / "scripts/llama-src")))
    peer = args.llama_server or sh(str(ROOT / "scripts/build-llama-server"))
    from PIL import Image

    from localserve.common.config import resolve_model
    with tempfile.TemporaryDirectory() as folder:
        images = [str(Path(folder) / f"{n}.png") for n in ("truck", "cat")]
        for path, colour in zip(images, ((200, 30, 30), (30, 200, 30))):
            Image.new("RGB", (64, 48), colour).save(path)
        (Path(folder) / "llama_tests_plugin.py").write_text(PLUGIN % tuple(images))
        stand_in = Path(folder) / "llama-server"
        stand_in.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "
                            f"--serve \"$@\"\n")
        stand_in.chmod(0o755)
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(stand_in),
               "PYTHONPATH": os.pathsep.join([args.deps, folder, str(ROOT), "."]),
               "LLAMA_TESTS_MODEL": str(resolve_model(None)),
               "LLAMA_TESTS_MMPROJ": sh(str(ROOT / "scripts/make-projector"))}
        tests = src / "tools/server/tests"
        mine = run(args.files, tests, env)
        theirs = run(args.files, tests, {**env, "LLAMA_TESTS_PEER": peer})
    for name in args.files:
        print(f"{name}: localserve {mine[name][0]} of {mine[name][1]}, "
              f"llama-server {theirs[name][0]} of {theirs[name][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# What every weir Python worker begins with (python_worker.rs puts it
# before the worker's own script): the protocol runs on copies of
# descriptors 0 and 1, and descriptor 1 then points at stderr and 0 at
# /dev/null, so the user's prints, and the output of any subprocess the
# user's code runs, go to weir's log and never corrupt the protocol. The
# user's file is argv[1].
import importlib.util
import json
import os
import sys
import traceback

path = sys.argv[1]
out = os.fdopen(os.dup(1), "w", encoding="utf-8")
requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
sys.stdout.flush()
os.dup2(2, 1)
devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)
os.close(devnull)
sys.stdout = sys.stderr
sys.stdin = open(os.devnull, "r")


def send(obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()


def last_line(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]


def where(exc):
    # The innermost frame in the user's file, for the error line.
    mine = os.path.realpath(path)
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == mine
    ]
    return f" (line {frames[-1].lineno})" if frames else ""


def load_user_file(module_name):
    # The user's file as a module; a file that does not load ends the worker, saying why.
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as exc:
        send({"ok": False, "error": f"cannot load it: {last_line(exc)}{where(exc)}"})
        sys.exit(1)

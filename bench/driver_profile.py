"""Where a training script's driver process spends its time: a stack sampler over every Python thread.

    python bench/driver_profile.py --json profile.json examples/grpo_async.py --model /tmp/smollm2-hf --steps 20

Runs the script in this process (``runpy``) with a daemon thread that reads every other thread's stack each
``--interval-ms`` (2 ms) once the main thread has entered ``--from-function`` (``train_step``: start-up is left out),
and writes, per thread, the leaf lines most often seen, every function on the stack (inclusive counts), and the most
frequent stacks. A count times the interval is wall time, whether the thread ran or waited there. The sampler takes
the GIL for each sample, so it slows the script a little (about 1.4x the step at 2 ms); compare runs made with it.
``bench/async_grpo.py --profile-driver`` runs both of its modes under it: the async loop's extra driver time was
found this way (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import threading
from pathlib import Path


def _where(frame, *, line: bool) -> str:
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
    return f"{where}:{frame.f_lineno}" if line else where


class StackSampler:
    """Samples the stacks of every thread but its own every ``interval_s``, from the first time the main thread's
    stack holds a function named ``start_in`` (None: at once)."""

    def __init__(self, *, interval_s: float = 0.002, start_in: str | None = "train_step", depth: int = 10) -> None:
        self.interval_s, self.start_in, self.depth = interval_s, start_in, depth
        self.samples = 0
        self._leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stacks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._started = start_in is None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="driver-profile")

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _main_entered(self, frames: dict) -> bool:
        frame = frames.get(threading.main_thread().ident)
        while frame is not None:
            if frame.f_code.co_name == self.start_in:
                return True
            frame = frame.f_back
        return False

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            frames = sys._current_frames()
            if not self._started:
                self._started = self._main_entered(frames)
                if not self._started:
                    continue
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            self.samples += 1
            for ident, frame in frames.items():
                if ident == me:
                    continue
                name = names.get(ident, f"thread-{ident}")
                self._leaf[name][_where(frame, line=True)] += 1
                seen, chain = set(), []
                while frame is not None:
                    function = _where(frame, line=False)
                    if len(chain) < self.depth:
                        chain.append(_where(frame, line=True))
                    if function not in seen:
                        seen.add(function)
                        self._inclusive[name][function] += 1
                    frame = frame.f_back
                self._stacks[name][" <- ".join(chain)] += 1

    def report(self, *, top: int = 40) -> dict:
        return {"samples": self.samples, "interval_s": self.interval_s, "start_in": self.start_in,
                "threads": {name: {"leaf": self._leaf[name].most_common(top),
                                   "inclusive": self._inclusive[name].most_common(),  # every function: few
                                   "stacks": self._stacks[name].most_common(top // 2)} for name in self._leaf}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where the profile goes")
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--from-function", default="train_step",
                        help="start sampling once the main thread is inside a function of this name ('' : at once)")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    sampler = StackSampler(interval_s=args.interval_ms / 1000, start_in=args.from_function or None).start()
    sys.argv = [args.script, *args.script_args]
    code = 0
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sampler.stop()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(sampler.report(), indent=1) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())

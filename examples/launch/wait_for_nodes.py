"""Wait until the Ray cluster at ``$RAY_ADDRESS`` (or ``--address``) has ``--nodes`` alive nodes; exit 1 on timeout.

Used by the launch recipes between ``ray start`` and the first job: ``ray start --block`` returns nothing to wait on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    import ray

    deadline = time.monotonic() + args.timeout
    while True:
        try:
            ray.init(address=args.address, log_to_driver=False)
            break
        except ConnectionError as error:  # the head is not up yet
            if time.monotonic() > deadline:
                print(f"no Ray cluster at {args.address} after {args.timeout:g} s: {error}", file=sys.stderr)
                return 1
            time.sleep(2)
    try:
        while True:
            alive = [node for node in ray.nodes() if node["Alive"]]
            if len(alive) >= args.nodes:
                gpus = sum(node["Resources"].get("GPU", 0) for node in alive)
                print(f"Ray cluster at {args.address}: {len(alive)} node(s), {gpus:g} GPU(s)")
                return 0
            if time.monotonic() > deadline:
                print(f"only {len(alive)} of {args.nodes} nodes joined after {args.timeout:g} s", file=sys.stderr)
                return 1
            time.sleep(2)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

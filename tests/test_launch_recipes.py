"""The Slurm recipe (examples/launch/slurm.sbatch) run without Slurm (issue 24, "CPU parts").

``bash slurm.sbatch`` runs with the ``SLURM_*`` variables sbatch would set (read from the script's own ``#SBATCH``
lines, or overridden as ``sbatch --nodes=4`` would) and stand-ins for ``scontrol``, ``srun``, ``ray`` and ``python`` on
``PATH`` that record every call (its arguments and the variables the recipe exports) and return at once. The test
checks the command lines the recipe would run: the head's ``ray start`` on the first host, one worker ``ray start`` per
other host joining the head's address, the node waits, the auth token reaching every step, and the ``ray job submit``
entrypoint; then the entrypoint's arguments are parsed by hello_placement.py and the plan it would reserve is built.

Not exercised here: Slurm itself (allocation, ``srun`` step placement and GPU binding), real ``ray start`` processes
on several machines, the network between them, the dashboard's job server and the job's run (the multi-raylet Ray
part is exercised in test_workers_multinode.py and the launch check in test_workers.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "launch" / "slurm.sbatch"
HOSTS = ("gpu-1", "gpu-2", "gpu-3", "gpu-4")
HEAD_IP = "10.0.0.1"

# One stand-in for every command: records "name\0arg\0...\0--env--\0KEY=value\0..." in its own file under $CALLS.
STAND_IN = r"""#!/bin/bash
name="$(basename "$0")"
file="$CALLS/$(date +%s%N)-$$-$name"
{ printf '%s\0' "$name" "$@" --env--
  for key in RAY_ADDRESS RAY_AUTH_MODE RAY_AUTH_TOKEN RAY_TMP HEAD NODES GPUS_PER_NODE; do
    printf '%s\0' "$key=${!key-<unset>}"; done; } > "$file"
case "$name" in
  scontrol) printf '%s\n' $FAKE_HOSTS ;;
  ray) if [ "$1" = get-auth-token ]; then echo fake-token; fi ;;
  srun) for arg in "$@"; do if [ "$arg" = hostname ]; then echo "$FAKE_HEAD_IP fe80::1"; fi; done ;;
esac
"""


def _sbatch_options() -> dict[str, str]:
    """The script's ``#SBATCH --key=value`` lines."""
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.M))


def _run_sbatch(tmp_path: Path, *args: str, nodes: int | None = None) -> list[tuple[str, list[str], dict[str, str]]]:
    options = _sbatch_options()
    num_nodes = nodes or int(options["nodes"])
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name in ("scontrol", "srun", "ray", "python"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "CALLS": str(calls),
           "FAKE_HOSTS": " ".join(HOSTS[:num_nodes]), "FAKE_HEAD_IP": HEAD_IP,
           # what sbatch sets from the #SBATCH lines (sbatch --nodes=N overrides the node count)
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"gpu-[1-{num_nodes}]",
           "SLURM_NNODES": str(num_nodes), "SLURM_GPUS_PER_TASK": options["gpus-per-task"],
           "SLURM_CPUS_PER_TASK": options["cpus-per-task"]}
    result = subprocess.run(["bash", str(SBATCH), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    recorded = []
    for path in sorted(calls.iterdir()):
        name, *rest = path.read_text().split("\0")[:-1]
        split = rest.index("--env--")
        recorded.append((name, rest[:split], dict(item.split("=", 1) for item in rest[split + 1:])))
    return recorded


def _ray_starts(calls) -> list[tuple[str, list[str], dict[str, str]]]:
    """(host, ray start arguments, env) of each ``srun ... -w HOST ray start ...``."""
    starts = []
    for name, args, env in calls:
        if name == "srun" and "ray" in args:
            at = args.index("ray")
            assert args[:at] == ["--nodes=1", "--ntasks=1", "-w", args[at - 1]], args  # one task on one named host
            starts.append((args[at - 1], args[at + 1:], env))
    return starts


@pytest.mark.parametrize("nodes,extra", [(None, ()), (4, ("--tp", "2"))], ids=["as-written-2-nodes", "4-nodes-tp2"])
def test_slurm_recipe_runs_the_head_workers_waits_and_job_it_should(tmp_path, nodes, extra):
    calls = _run_sbatch(tmp_path, *extra, nodes=nodes)
    options = _sbatch_options()
    num_nodes, gpus, cpus = nodes or int(options["nodes"]), options["gpus-per-task"], options["cpus-per-task"]
    assert options["ntasks-per-node"] == "1"  # one Ray node per machine
    address = f"{HEAD_IP}:6379"
    assert [args for name, args, _ in calls if name == "scontrol"] == [["show", "hostnames", f"gpu-[1-{num_nodes}]"]]
    hostname = [args for name, args, _ in calls if name == "srun" and "hostname" in args]
    assert hostname == [["--nodes=1", "--ntasks=1", "-w", HOSTS[0], "hostname", "--ip-address"]]

    starts = _ray_starts(calls)
    heads = [(host, args) for host, args, _ in starts if "--head" in args]
    assert heads == [(HOSTS[0], ["start", "--head", f"--node-ip-address={HEAD_IP}", "--port=6379",
                                 f"--num-cpus={cpus}", f"--num-gpus={gpus}", "--temp-dir=/tmp/ray-4242",
                                 "--dashboard-host=0.0.0.0", "--dashboard-port=8265", "--block"])]
    workers = sorted((host, args) for host, args, _ in starts if "--head" not in args)
    assert workers == [(host, ["start", f"--address={address}", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
                               "--temp-dir=/tmp/ray-4242", "--block"]) for host in HOSTS[1:num_nodes]]
    # token mode by default: the generated token reaches every step and the job submission
    assert {env["RAY_AUTH_MODE"] for *_, env in starts} == {"token"}
    assert {env["RAY_AUTH_TOKEN"] for *_, env in starts} == {"fake-token"}

    waits = [(args, env["RAY_ADDRESS"]) for name, args, env in calls if name == "python"]
    script = str(ROOT / "examples" / "launch" / "wait_for_nodes.py")
    assert sorted(waits) == sorted([([script, "--nodes", "1", "--timeout", "300"], address),
                                    ([script, "--nodes", str(num_nodes), "--timeout", "600"], address)])

    submits = [(args, env) for name, args, env in calls if name == "ray" and args[:2] == ["job", "submit"]]
    assert len(submits) == 1
    args, env = submits[0]
    assert env["RAY_AUTH_TOKEN"] == "fake-token"
    assert args[2:6] == ["--address", f"http://{HEAD_IP}:8265", "--working-dir", "."]
    runtime_env = json.loads(args[args.index("--runtime-env-json") + 1])
    assert runtime_env["py_modules"] == ["src/rlhfkit"] and (ROOT / "src" / "rlhfkit").is_dir()
    entry = args[args.index("--") + 1:]
    assert entry == ["python", "examples/launch/hello_placement.py", "--nodes", str(num_nodes), "--gpus-per-node",
                     gpus, *extra]

    # The job's entrypoint, as far as it goes without a cluster: its arguments and the plan it would reserve.
    spec = importlib.util.spec_from_file_location("hello_placement_for_slurm", ROOT / entry[1])
    hello = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hello)
    plan = hello.build_plan(hello.parse_args(entry[2:]))
    tp = int(extra[1]) if extra else 1
    assert plan.bundles_per_node() == (int(gpus),) * num_nodes
    for engine in plan.ranks("rollout"):  # each TP group: contiguous GPUs of one node
        assert engine.gpus == tuple(range(engine.gpus[0], engine.gpus[0] + tp)) and engine.gpus[-1] < int(gpus)
    assert f"{num_nodes * int(gpus)} of {num_nodes * int(gpus)} GPUs on {num_nodes} node(s)" in str(plan)


def test_slurm_recipe_stops_when_a_step_fails(tmp_path):
    """set -euo pipefail: a failing wait (the head never came up) ends the script before the job is submitted."""
    options = _sbatch_options()
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name in ("scontrol", "srun", "ray"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").write_text("#!/bin/bash\necho 'no Ray cluster' >&2\nexit 1\n")
    (bin_dir / "python").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "CALLS": str(calls),
           "FAKE_HOSTS": " ".join(HOSTS[:2]), "FAKE_HEAD_IP": HEAD_IP, "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "gpu-[1-2]", "SLURM_GPUS_PER_TASK": options["gpus-per-task"],
           "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no Ray cluster" in result.stderr
    recorded = [path.read_text().split("\0") for path in calls.iterdir()]
    assert not [call for call in recorded if call[0] == "ray" and "submit" in call]  # no job submitted
    assert not [call for call in recorded if call[0] == "srun" and "--address=10.0.0.1:6379" in call]  # no workers

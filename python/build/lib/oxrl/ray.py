"""oxrl's ranks on a Ray cluster: a placement group of one bundle per rank, one actor per
bundle running ``oxrl train`` with the variables torchrun would set, and restarts of the whole
group from the last checkpoint (``--resume``) when a rank dies, a bounded number of times.

Call it inside ``ray.init(address="auto")`` (or any initialised Ray); ``oxrl.Trainer`` does when
it runs several ranks under Ray. Ray places the processes; oxrl's own rendezvous (rank 0 serves
the store on a free port of its node) and collectives do the rest.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .trainer import OxrlError


@ray.remote
class OxrlRank:
    """One rank: reports where it runs, then runs the binary to its end."""

    def address(self) -> Tuple[str, int]:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def run(self, argv: Sequence[str], env: Dict[str, str], quiet: bool) -> Tuple[int, str]:
        """Runs ``argv`` with ``env`` added; returns the exit status and the last ``error:``
        line (or the output's tail). Ray forwards what the actor prints to the driver."""
        full = dict(os.environ)
        full.update(env)
        proc = subprocess.Popen(
            list(argv), env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace",
        )
        error, tail = "", []
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("error: "):
                error = line[len("error: ") :].strip()
            tail = (tail + [line.rstrip("\n")])[-5:]
            if not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
        code = proc.wait()
        return code, error or " | ".join(tail)


def _rank_env(rank: int, world: int, nodes: List[str], master: Tuple[str, int]) -> Dict[str, str]:
    node = nodes[rank]
    local_rank = sum(1 for n in nodes[:rank] if n == node)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(sum(1 for n in nodes if n == node)),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
    }


def _attempt(
    argv: Sequence[str],
    world: int,
    use_gpu: bool,
    cpus_per_worker: float,
    quiet: bool,
) -> Optional[str]:
    """One launch of the whole group; ``None`` when every rank succeeded, else why not."""
    bundle = {"CPU": cpus_per_worker}
    if use_gpu:
        bundle["GPU"] = 1
    group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    ray.get(group.ready())
    actors = [
        OxrlRank.options(
            num_cpus=cpus_per_worker,
            num_gpus=1 if use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        ).remote()
        for i in range(world)
    ]
    try:
        addresses = ray.get([a.address.remote() for a in actors])
        nodes = [ip for ip, _ in addresses]
        master = addresses[0]
        runs = [
            a.run.remote(list(argv), _rank_env(i, world, nodes, master), quiet or i > 0)
            for i, a in enumerate(actors)
        ]
        failures = []
        for rank, run in enumerate(runs):
            try:
                code, message = ray.get(run)
            except ray.exceptions.RayError as e:  # the actor itself died
                failures.append(f"rank {rank}: its Ray actor died ({type(e).__name__})")
                continue
            if code != 0:
                failures.append(f"rank {rank} (exit {code}): {message}")
        return "; ".join(failures) or None
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(group)


def run_ranks(
    argv: Sequence[str],
    world: int,
    *,
    use_gpu: bool = True,
    max_restarts: int = 2,
    cpus_per_worker: float = 1,
    quiet: bool = False,
) -> int:
    """Runs ``argv`` as ``world`` ranks; after a failed launch the group restarts with
    ``--resume`` (from the newest complete checkpoint) up to ``max_restarts`` times. Returns the
    number of restarts taken; raises :class:`OxrlError` when none is left."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    argv = list(argv)
    restarts = 0
    while True:
        failure = _attempt(argv, world, use_gpu, cpus_per_worker, quiet)
        if failure is None:
            return restarts
        if restarts >= max_restarts:
            raise OxrlError(
                f"the group of {world} ranks failed after {restarts} restart(s): {failure}", 1
            )
        restarts += 1
        sys.stderr.write(
            f"oxrl.ray: {failure}; restarting the group from its last checkpoint "
            f"({restarts} of {max_restarts})\n"
        )
        sys.stderr.flush()
        if "--resume" not in argv:
            argv.append("--resume")
        time.sleep(1)

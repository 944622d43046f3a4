"""Mirror of slime's RayTrainGroup: actors created rank 0 first, calls fanned out with ray.get."""

from __future__ import annotations

import os

import ray

from tests.slime_mirror.backends.megatron_utils.actor import MegatronTrainRayActor


class RayTrainGroup:
    """``num_gpus_per_actor`` as slime's (a fraction shares one GPU; 0 hides the GPUs, as CPU
    tests want); ``device`` (mirror only) is passed to each actor's init."""

    def __init__(self, args, num_actors, seed_spec, env_vars=None, num_gpus_per_actor=0, device="cpu"):
        TrainRayActor = ray.remote(num_cpus=0.5, num_gpus=num_gpus_per_actor,
                                   runtime_env={"env_vars": env_vars or {}})(MegatronTrainRayActor)
        self._actor_handlers = []
        master_addr = master_port = None
        for rank in range(num_actors):
            actor = TrainRayActor.options(num_cpus=0.5, num_gpus=num_gpus_per_actor).remote(
                num_actors, rank, master_addr, master_port)
            if rank == 0:
                master_addr, master_port = ray.get(actor.get_master_addr_and_port.remote())
            self._actor_handlers.append(actor)
        ray.get([a.init.remote(args, "actor", seed_spec, device=device) for a in self._actor_handlers])

    def save_model(self, rollout_id, force_sync=False):
        return ray.get([actor.save_model.remote(rollout_id, force_sync=force_sync) for actor in self._actor_handlers])

    def onload(self):
        """As slime's: every actor's wake_up."""
        return ray.get([actor.wake_up.remote() for actor in self._actor_handlers])

    def offload(self):
        """As slime's: every actor's sleep."""
        return ray.get([actor.sleep.remote() for actor in self._actor_handlers])


def repo_env() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    return {"PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "tests", "stand_ins")]),
            "OMP_NUM_THREADS": "1"}

"""Mirror of slime's RayTrainGroup (624b824a): actors created rank 0 first, calls fanned out with ray.get,
and `--release-train`'s create / save_model / release."""

from __future__ import annotations

import os

import ray

from tests.slime_mirror.backends.megatron_utils.actor import MegatronTrainRayActor


class RayTrainGroup:
    """``num_gpus_per_actor`` as slime's (a fraction shares one GPU; 0 hides the GPUs, as CPU
    tests want); ``device`` (mirror only) is passed to each actor's init. ``create=False`` leaves
    the actors to `create()`, as slime's `--release-train` loop does every step."""

    def __init__(self, args, num_actors, seed_spec, env_vars=None, num_gpus_per_actor=0, device="cpu",
                 create=True):
        self.args, self._num_actors, self._seed_spec, self._device = args, num_actors, seed_spec, device
        self._num_gpus_per_actor = num_gpus_per_actor
        self._remote_cls = ray.remote(num_cpus=0.5, num_gpus=num_gpus_per_actor,
                                      runtime_env={"env_vars": env_vars or {}})(MegatronTrainRayActor)
        self._actor_handlers = []
        self.start_rollout_ids = self.create() if create else None

    def _allocate(self):
        self._actor_handlers = []
        master_addr = master_port = None
        for rank in range(self._num_actors):
            actor = self._remote_cls.options(num_cpus=0.5, num_gpus=self._num_gpus_per_actor).remote(
                self._num_actors, rank, master_addr, master_port)
            if rank == 0:
                master_addr, master_port = ray.get(actor.get_master_addr_and_port.remote())
            self._actor_handlers.append(actor)

    def create(self):
        """As slime's: new actors, each `init` (which loads `args.load`); their start rollout ids."""
        if self._actor_handlers:
            return None
        self._allocate()
        return ray.get([a.init.remote(self.args, "actor", self._seed_spec, device=self._device)
                        for a in self._actor_handlers])

    def release(self):
        """As slime's: kill every actor (slime then sleeps 5 s for the GPU memory to come back; no GPU here)."""
        actors, self._actor_handlers = self._actor_handlers, []
        for actor in actors:
            ray.kill(actor, no_restart=True)

    def async_train(self, rollout_id, rollout_data_ref=None):
        return [actor.train.remote(rollout_id, rollout_data_ref) for actor in self._actor_handlers]

    def save_model(self, rollout_id, force_sync=False):
        """As slime's: every actor's save_model; with --release-train the next actors load this save."""
        ret = ray.get([actor.save_model.remote(rollout_id, force_sync=force_sync) for actor in self._actor_handlers])
        if getattr(self.args, "release_train", False):
            self.args.load = self.args.save
            self.args.ckpt_step = None
            self.args.finetune = False
            self.args.no_load_optim = self.args.no_save_optim
            self.args.no_load_rng = False
        return ret

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

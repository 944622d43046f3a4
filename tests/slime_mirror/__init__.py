"""A CPU mirror of the parts of THUDM/slime that its checkpoint save goes through:
`RayTrainGroup.save_model` -> `MegatronTrainRayActor.save_model` (with `wake_up`/`sleep`
around the save under `--offload-train`, `maybe_finalize_async_save`, `force_sync`, `--save-hf`)
-> `backends.megatron_utils.model.save` -> the module-global `save_checkpoint`, and its load:
the actor's `init` -> `backends.megatron_utils.checkpoint.load_checkpoint` -> the module-global
`_load_checkpoint_megatron`, with the same module layout, names and call signatures, launched
as real Ray actors.

Mirrored commit: THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21, main,
"[NFC] Add observability subfolder (#2298)"): `slime/backends/megatron_utils/actor.py`
(`save_model`, `sleep`, `wake_up`), `model.py` (`save`), `checkpoint.py` (re-export, `load_checkpoint`),
`slime/ray/actor_group.py` (`save_model`, `onload`, `offload`, and `--release-train`'s `create`/`release`),
`slime/utils/reloadable_process_group.py` (the WORLD destroy/reload cycle) and
`slime/utils/tensor_backper.py` (the TensorBackuper keeping the weights in host memory), with the
memory layout slime ships under `--offload-train` (its Megatron patch's parameter and gradient
buffers in torch_memory_saver regions without CPU backup; tests/stand_ins_tms stands for the saver on CPU).

What differs is only what cannot run here: gloo instead of NCCL, no GPUs (or one, for the GPU
tests), no SGLang, and a Megatron-shaped synthetic model/optimizer instead of a trained
GPTModel; each difference is listed where it is (actor.py, utils/reloadable_process_group.py)."""

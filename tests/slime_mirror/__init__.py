"""A CPU mirror of the parts of THUDM/slime (v0.2.x) that its checkpoint save goes through:
`RayTrainGroup.save_model` -> `MegatronTrainRayActor.save_model` ->
`backends.megatron_utils.model.save` -> the module-global `save_checkpoint`, with the same
module layout, names and call signatures, launched as real Ray actors. What differs is
only what cannot run here: gloo instead of NCCL, no GPUs, no SGLang, and a Megatron-shaped
synthetic model/optimizer instead of a trained GPTModel."""

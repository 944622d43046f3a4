from megatron.training.global_vars import get_args

from .checkpoint import save_checkpoint


def save(iteration, model, optimizer, opt_param_scheduler) -> None:
    """As slime's `save`: the name `save_checkpoint` is looked up in this module. (slime also turns
    Megatron's forward pre-hooks off and on around it under --overlap-param-gather with the
    distributed optimizer; the synthetic model has no hooks.)"""
    get_args()
    save_checkpoint(
        iteration, model, optimizer, opt_param_scheduler,
        num_floating_point_operations_so_far=0,
        checkpointing_context=None,
        train_data_iterator=None,
        preprocess_common_state_dict_fn=None,
    )

"""The model's 16-bit weight gradients: the rules every reader and writer of its dict shares.

Under bfloat16 autocast version 4 can keep a weight's gradient as the 16-bit product of its GEMM, in a dict
{parameter: gradient} that the model owns (TinyLlama.sixteen_bit_gradients), instead of widening it into a
float32 .grad. Four places read or write that dict: the weight-gradient stream (backward_overlap.py), the fused
output head and loss (linear_cross_entropy.py), the Triton AdamW (adamw.py) and the model's zero_grad. These are
the two rules they share, in a file of their own so that none of them imports another for them.
"""


def refuse_two_gradients(param, sixteen_bit_gradient) -> None:
    """A parameter has a float32 .grad or a 16-bit gradient (sixteen_bit_gradient, from the dict), never both: the
    one ValueError of every place that reads or adds to them (the Triton AdamW, the weight-gradient stream, the
    fused loss)."""
    if sixteen_bit_gradient is not None and param.grad is not None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has two gradients, a float32 .grad and a 16-bit "
                         f"one: clear them first (the optimizer's or the model's zero_grad)")


def clear_16bit_gradients(gradients: dict, params, set_to_none: bool) -> None:
    """zero_grad for the 16-bit gradients of these parameters in `gradients` ({parameter: gradient}): dropped, or
    set to zero."""
    for param in params:
        if set_to_none:
            gradients.pop(param, None)
        elif param in gradients:
            gradients[param].zero_()

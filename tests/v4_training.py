"""A few training steps of version 4 with its embedding frozen, graphed or eager: shared by the graph and the
optimizer tests (GPU only). The embedding's gradient is summed with atomics, in a different order in each run,
and Adam's normalised update would turn those last-bit differences into visible ones wherever a gradient is
nearly zero; with the embedding frozen, two runs of the same step compute the same numbers."""
from types import SimpleNamespace

import torch

from tinytransformer.config import ModelConfig, TrainConfig
from tinytransformer.training.step import EagerStep


def train_frozen_embedding(graphed, num_layers=2, amp_dtype=None, use_triton_adamw=True, steps=8,
                           sixteen_bit_weight_gradients=True):
    """`steps` training steps on fixed random batches: GraphedStep (2 eager warm-up steps, then replays) or
    EagerStep. amp_dtype None: float32; else autocast in that dtype (and the graph's weight gradients 16-bit unless
    sixteen_bit_weight_gradients is False). Returns losses, step, model, optimizer, train."""
    from version4_triton_ultra.graphed_step import GraphedStep
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    config = ModelConfig(num_layers=num_layers)
    train = TrainConfig(batch_size=8, seq_len=128, use_amp=amp_dtype is not None, amp_dtype=amp_dtype or "bfloat16")
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (8, 129), device="cuda", generator=generator)
               for _ in range(steps)]
    model = TinyLlama(config).cuda()
    model.capturable_optimizer = graphed
    model.use_triton_adamw = use_triton_adamw
    model.embed_tokens.weight.requires_grad_(False)
    optimizer = model.configure_optimizer(train)
    device = torch.device("cuda")
    step = (GraphedStep(model, optimizer, device, train, warmup_steps=2,
                        sixteen_bit_weight_gradients=sixteen_bit_weight_gradients) if graphed
            else EagerStep(model, optimizer, device, train))
    losses = [step(b[:, :-1].contiguous(), b[:, 1:].contiguous()).item() for b in batches]
    return SimpleNamespace(losses=losses, step=step, model=model, optimizer=optimizer, train=train)

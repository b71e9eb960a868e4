"""Helpers to prove two versions compute the same model: same canonical weights in, same logits, loss, gradients out."""
import torch

from tinytransformer.weights import init_canonical_weights


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")   # NaN never passes
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def forward_backward(model, weights, input_ids, targets, autocast_dtype=None):
    """Logits (inference call), loss and canonical-layout gradients (training call) of one model."""
    model.load_canonical(weights)
    model.zero_grad(set_to_none=True)
    device_type = input_ids.device.type
    context = (torch.autocast(device_type=device_type, dtype=autocast_dtype) if autocast_dtype
               else torch.autocast(device_type=device_type, enabled=False))
    with context:
        with torch.no_grad():
            logits, _ = model(input_ids)
        _, loss = model(input_ids, targets)
    loss.backward()
    grads = model.to_canonical({name: p.grad for name, p in model.named_parameters()})
    return logits.float(), loss.detach().float(), grads


def compare(reference, candidate, tolerance: float) -> list[str]:
    """Names (logits, loss, parameter names) whose relative error exceeds the tolerance."""
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = reference, candidate
    failures = []
    if rel_err(logits, ref_logits) > tolerance:
        failures.append(f"logits ({rel_err(logits, ref_logits):.2e})")
    if rel_err(loss, ref_loss) > tolerance:
        failures.append(f"loss ({rel_err(loss, ref_loss):.2e})")
    for name, ref_grad in ref_grads.items():
        if name not in grads or grads[name] is None:
            failures.append(f"{name} (no gradient)")
        elif rel_err(grads[name], ref_grad) > tolerance:
            failures.append(f"{name} ({rel_err(grads[name], ref_grad):.2e})")
    return failures


def random_batch(config, batch, seq, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def canonical(config, seed=0):
    return init_canonical_weights(config, seed)

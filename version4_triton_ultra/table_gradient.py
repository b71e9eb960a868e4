"""The embedding table's float32 gradient, kept from step to step and zeroed row by row instead of whole.

The first norm's backward kernel adds each token's gradient into the row of the table it was looked up from
(atomic additions, kernels/add_rmsnorm.py), so the table's [V, D] float32 gradient must start at zero. A batch of
N tokens touches at most N rows: at the medium preset 8,192 of 32,000. Zeroing the whole gradient every step
(131 MB at the medium preset) and having the optimizer read it whole (131 MB more) moves mostly zeros.

RowTrackedGradient keeps one gradient tensor for the table across steps, zero except the rows the last backward
pass added into. Each backward pass zeroes only those rows (at most N of them: 34 MB at the medium preset), adds
its own, and flags the rows it touched (one uint8 a row, `flags`), which it puts in `gradient_rows` (the model's
dict, which TritonAdamW reads: kernels/adamw.py) so that the optimizer reads those rows' gradient only. The
gradient the user finds in the table's .grad after the backward pass is the whole one, as before; the arithmetic
of every row is the same (the atomic additions into a row that starts at zero).

What it needs to stay right: nothing but these backward passes adds into .grad between steps (the optimizer's
zero_grad, which lets .grad go, and scaling it in place are fine). Where that cannot be known it falls back:
  - the table has a .grad that is not this gradient (set by someone else): the plain way (zeros, additions,
    handed to autograd), the flags withdrawn so that the optimizer reads every row, and the next pass zeroes the
    whole tensor;
  - a second backward pass before zero_grad (gradient accumulation): its rows are added into the same tensor, the
    flags of both passes kept, and the next pass zeroes the whole tensor (the row list holds one pass's ids).
"""
import torch


class RowTrackedGradient:
    """One table's gradient, zero except the rows `touched` lists (see the module docstring)."""

    def __init__(self, gradient_rows: dict):
        self.gradient_rows = gradient_rows   # {table: flags}, for the optimizer
        self.gradient = None   # [V, D] float32
        self.flags = None      # [V] uint8: 1 where a row of the gradient may be non-zero
        self.touched = None    # the ids the last backward pass added rows at (a copy of its own, int64)
        self.zero_whole = True   # rows outside `touched` may be non-zero: zero the whole tensor next

    def target_for(self, table: torch.Tensor, ids: torch.Tensor):
        """Where this backward pass adds its rows of `ids` for `table` (the leaf parameter): this object's gradient,
        made zero except where an earlier pass of this step added (that stays, to be added to), with the flags of
        ids set; and already the table's .grad, so that the caller hands autograd nothing. Or None: the caller
        adds into zeros of its own and hands them to autograd (the table has a .grad from elsewhere)."""
        if table.grad is not None and table.grad is not self.gradient:
            self.withdraw(table)
            return None
        if not self._fits(table):
            self.gradient = torch.empty(table.shape, dtype=torch.float32, device=table.device)
            self.flags = torch.empty(table.shape[0], dtype=torch.uint8, device=table.device)
            self.touched, self.zero_whole = None, True
        ids = ids.to(torch.int64)   # index_fill_'s index dtype
        if table.grad is None:   # the first pass of a step: clear what the last step left
            self._clear()
            self._remember(ids)
            table.grad = self.gradient
        else:   # a second pass adds to the first: `touched` cannot list both, so the next step zeroes everything
            self.zero_whole = True
        self.flags.index_fill_(0, ids, 1)
        self.gradient_rows[table] = self.flags
        return self.gradient

    def withdraw(self, table: torch.Tensor) -> None:
        """A backward pass that gave the table a gradient some other way: the optimizer reads it whole, and the
        next pass here zeroes the whole tensor."""
        self.gradient_rows.pop(table, None)
        self.zero_whole = True

    def _fits(self, table) -> bool:
        return (self.gradient is not None and self.gradient.shape == table.shape
                and self.gradient.device == table.device)

    def _clear(self) -> None:
        if self.zero_whole:
            self.gradient.zero_()
            self.flags.zero_()
        else:
            self.gradient.index_fill_(0, self.touched, 0.0)
            self.flags.index_fill_(0, self.touched, 0)
        self.zero_whole = False

    def _remember(self, ids) -> None:
        # Copied into a tensor of its own (the same memory at every step, as a captured graph needs).
        if self.touched is None or self.touched.shape != ids.shape:
            self.touched = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
        self.touched.copy_(ids)

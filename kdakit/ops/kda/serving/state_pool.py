"""``chunk_kda(..., state_indices=)``: gather the initial states from a state pool and scatter the final
states back, padded sequences (``-1``) reading zeros, giving zero output and writing nothing.

Everything here runs on the device with shapes fixed by the call's metadata: no read of an index
value on the host and no data-dependent size, so the pool path makes no device->host
synchronization and captures in a CUDA graph. The host check of the index values
(``validate.check_state_pool``) is separate; when it ran, its host copy (``host``) lets the common
case with no padded sequence skip the masks. With or without it the results are the same bits:
the masks keep real values as they are (``torch.where`` selects, never computes).
"""

from __future__ import annotations

import torch


def _none_padded(host) -> bool:
    """True only when the host copy of the indices is known and holds no ``-1``."""
    return host is not None and all(i >= 0 for i in host)


def gather_pool_rows(pool, state_indices, host):
    """Sequence n's initial state from pool row ``state_indices[n]``, zeros where it is -1.

    Returns ``(rows [N, ...] in the pool's dtype, valid: bool [N] on the indices' device)``."""
    idx = state_indices.long()
    valid = idx >= 0
    rows = pool[idx.clamp(min=0)]  # a fresh tensor (advanced indexing), so it may be masked in place
    if not _none_padded(host):
        rows.masked_fill_(~valid[:, None, None, None], 0)
    return rows, valid


def zero_padded_outputs(o, valid, host, offsets):
    """o with the tokens of padded sequences set to zero (as ``kda_decode``); ``offsets``: the
    ``[N + 1]`` offsets on o's device for packed sequences (None for ``[N, T, ...]``).

    Out of place, so that o stays differentiable for the sequences that are not padded."""
    if _none_padded(host):
        return o
    if offsets is None:
        keep = valid.view(-1, 1, 1, 1)
    else:
        # token -> its sequence, sized by o's T so that no device value decides a shape
        lengths = (offsets[1:] - offsets[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=o.device), lengths, output_size=o.shape[1])
        keep = valid[seq].view(1, -1, 1, 1)  # the indices live on q's device (check_state_pool)
    return torch.where(keep, o, torch.zeros((), dtype=o.dtype, device=o.device))


def padded_row_writes(pool, values, rows, valid):
    """``(dest [N], values [N, ...])``: a write of all N entries into ``pool`` in which the entries
    that are not ``valid`` change nothing.

    Leaving them out would make the write's size data-dependent. So an invalid entry writes the row
    and value that the first valid entry writes (identical bytes, so the order of the duplicate writes
    does not matter), or row 0's own value back when none is valid. The first valid entry is picked
    with ``index_select`` on a ``[1]`` index: indexing with a 0-d device tensor reads it on the host,
    which a CUDA graph capture refuses. ``values`` has the pool's dtype; the result is a new tensor
    (pool row 0 is read before the write)."""
    first = torch.argmax(valid.to(torch.int32)).view(1)  # first valid entry, 0 if none (argmax: first maximum)
    any_valid = valid.index_select(0, first)  # [1]
    sink_row = torch.where(any_valid, rows.index_select(0, first), torch.zeros_like(any_valid, dtype=rows.dtype))
    ones = (1,) * (values.dim() - 1)
    sink_value = torch.where(any_valid.view(1, *ones), values.index_select(0, first), pool[:1])  # [1, ...]
    return torch.where(valid, rows, sink_row), torch.where(valid.view(-1, *ones), values, sink_value)


@torch.no_grad()
def scatter_pool_rows(pool, final, state_indices, valid, host) -> None:
    """Final states into their pool rows in place; padded sequences write nothing (``padded_row_writes``
    unless the host copy of the indices shows no padded sequence)."""
    idx = state_indices.long()
    final = final.detach().to(pool.dtype)
    if _none_padded(host):
        pool[idx] = final
        return
    if pool.shape[0] == 0 or idx.numel() == 0:
        return  # no row to write (checked indices into an empty pool are all -1)
    rows, values = padded_row_writes(pool, final, idx, valid)
    pool[rows] = values

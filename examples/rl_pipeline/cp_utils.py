"""Zigzag context parallelism over per-sample response tensors.

A packed sequence of `total_length` positions is cut into `2 * cp_size` equal chunks;
context-parallel rank r holds chunks r and `2 * cp_size - 1 - r`, which balances causal
attention work. Rank 0 therefore holds the first and the last chunk: the last response
token (where a trainer adds the sequence reward) lives on cp rank 0.

A response of `response_length` tokens occupies logit positions
`[total_length - response_length - 1, total_length - 1)` (logit p predicts token p + 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import mpu


def response_ranges(total_length: int, response_length: int, cp_rank: int, cp_size: int) -> list[tuple[int, int]]:
    """The `[start, end)` response-index ranges this rank holds, in the order it holds them."""
    if cp_size == 1:
        return [(0, response_length)]
    chunk = -(-total_length // (2 * cp_size))  # ceil
    first = total_length - response_length - 1  # logit position of response token 0
    ranges = []
    for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
        start = max(index * chunk - first, 0)
        end = min((index + 1) * chunk - first, response_length)
        if end > start:
            ranges.append((start, end))
    return ranges


def slice_with_cp(full: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """This cp rank's part of a full per-response tensor (a new tensor when cp > 1)."""
    cp_size = mpu.get_context_parallel_world_size()
    if cp_size == 1:
        return full
    ranges = response_ranges(total_length, response_length, mpu.get_context_parallel_rank(), cp_size)
    return torch.cat([full[start:end] for start, end in ranges]) if ranges else full[:0]


def gather_with_cp(local: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """The full per-response tensor from every cp rank's slice (an all-reduce of a new tensor)."""
    cp_size = mpu.get_context_parallel_world_size()
    if cp_size == 1:
        return local
    full = local.new_zeros(response_length)
    offset = 0
    for start, end in response_ranges(total_length, response_length, mpu.get_context_parallel_rank(), cp_size):
        full[start:end] = local[offset:offset + end - start]
        offset += end - start
    dist.all_reduce(full, group=mpu.get_context_parallel_group())
    return full

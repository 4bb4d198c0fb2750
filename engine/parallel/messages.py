"""What rank 0 tells the workers each step, and what a worker reports: msgspec Structs over a pipe.

A step's header (sizes, the host-side lists the attention needs, adapter slots to fill) goes down each
worker's pipe; its tensors (token ids, positions, KV slots, block tables, adapter slots per token) follow
as one broadcast over the process group, so tokens still in flight on rank 0's device (async scheduling)
reach the workers without a trip through the host. Workers never see requests, only step inputs.
"""

from __future__ import annotations

import msgspec
import torch


class SlotLoad(msgspec.Struct, frozen=True, array_like=True):
    """Fill adapter slot `slot` with this worker's shard of an adapter (rank 0 decided the slot and pages)."""

    slot: int
    pages: list[int]  # the pool pages it occupies, as on rank 0
    weights: bytes  # the shard's SlotImage.weights, raw
    table: bytes  # SlotImage.table (scales and ranks, the same on every rank), raw
    # An adapter's own embedding / head (engine/lora/vocab.py): its vocab table raw (b"": none); every
    # worker's vocabulary rows of them follow the headers as broadcasts (TensorParallelRank._loaded)
    vocab_table: bytes = b""


class EagerStep(msgspec.Struct, frozen=True, tag="eager"):
    loads: list[SlotLoad]
    num_tokens: int
    block_table_width: int
    num_logits_rows: int
    use_lora: bool
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    # Hidden rows rank 0 turns into logits for prompt logprobs (they ride in the broadcast), and how many
    # at once: the workers join those gathers in the same chunks (engine/prompt_logprobs.py).
    num_prompt_rows: int = 0
    prompt_chunk_rows: int = 1


class GraphStep(msgspec.Struct, frozen=True, tag="graph"):
    """A decode step replayed from the CUDA graph of bucket `size` (inputs broadcast into its buffers)."""

    loads: list[SlotLoad]
    num_seqs: int
    size: int
    use_lora: bool


class VerifyStep(msgspec.Struct, frozen=True, tag="verify"):
    """A speculative verification step replayed from the graph of bucket `size` (lanes of k + 1 rows,
    spec_decode/verify_graphs.py; inputs broadcast into its buffers)."""

    loads: list[SlotLoad]
    size: int
    use_lora: bool


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """Leave the loop and exit."""


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """The worker started (imports done) and joins the process group now."""


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """The worker's last word before it exits on an error."""

    message: str


ToWorker = EagerStep | GraphStep | VerifyStep | Stop
FromWorker = Hello | Failed

_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)
encode = msgspec.msgpack.encode


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def decode_from_worker(data: bytes) -> FromWorker:
    return _from_worker.decode(data)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def bytes_tensor(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)

"""What one rank's model runner does beyond tensor_parallel_size 1: build its shard, and exchange each
step with the other ranks (rank 0 sends, the workers receive).

Per step, rank 0 sends every worker a header down its pipe (engine/parallel/messages.py) and then
broadcasts the step's tensors; each worker builds the same inputs and runs the same forward pass on its
shard, in lock-step with rank 0 through the collectives inside the model. Adapter slots follow rank 0:
when rank 0 fills a slot (its `RankZeroLoRASlots.load`, called by the adapter manager), each worker's
shard of the adapter rides with the next step's header and is copied into the same slot before that
step runs, so a slot holds the same adapter on every rank whenever a step reads it. The vocabulary rows
of an adapter's own embedding and head (engine/lora/vocab.py) are too large for the pipe: the header
names the load, and rank 0 broadcasts every worker's rows over the group right after the headers.

Three kinds of step go down: eager (any batch; its tensors broadcast, then the same forward), decode
graph and verification graph (rank 0's static graph buffers broadcast into the worker's, then every rank
replays its own copy of the same graph, the collectives inside it). A step that needs prompt logprobs
is eager, and its header says which hidden rows rank 0 turns into logits: the workers join those
gathers (the vocabulary is split over the ranks) and drop what they get; only rank 0 computes the
log-probabilities.

Shutdown (rank 0, `shutdown` or the finalizer when the runner is collected), each wait bounded: wait for
the queued steps (if the workers are healthy), drop the CUDA graphs (they hold the communicator), stop
the workers (they exit without touching NCCL), then abort rank 0's communicator and leave the group
(engine/parallel/group.py says why an abort, not a destroy).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from engine.lora.dora import DoraBase
from engine.lora.pool import LoRAPool
from engine.lora.slots import SlotImage
from engine.lora.vocab import TABLE_COLUMNS, part_shapes
from engine.model.attention import AttentionMetadata
from engine.model.layers.sharding import TensorParallel
from engine.model.loader import load_model
from engine.parallel.group import LEAVE_TIMEOUT_S, ParallelGroup, free_port, run_bounded
from engine.parallel.lora_shards import RankZeroLoRASlots
from engine.parallel.messages import (
    EagerStep,
    GraphStep,
    SlotLoad,
    VerifyStep,
    bytes_tensor,
    encode,
    tensor_bytes,
)
from engine.parallel.plan import ROW_PARALLEL, ShardPlan
from engine.parallel.workers import Workers
from engine.prompt_logprobs import logit_chunk_rows
from engine.step_buffers import DecodeTwins


def _leave(held: list, workers: Workers, group: ParallelGroup, threads: int) -> None:
    """Rank 0's shutdown sequence (the module docstring): every wait bounded, none on the workers' NCCL."""
    device = group.device
    if device.type == "cuda" and workers.failed_reason is None:
        run_bounded(lambda: torch.cuda.synchronize(device), LEAVE_TIMEOUT_S, "waiting for the last steps")
    held.clear()  # the CUDA graphs (and what they hold) go before the communicator they captured
    workers.stop()
    group.leave()
    torch.set_num_threads(threads)


# Rows of an adapter's vocabulary matrix rank 0 stages on its device per broadcast (32 MiB at hidden 4096
# in bf16): how the workers' rows of adapters' own embeddings and heads travel (`_loaded`).
VOCAB_CHUNK_ROWS = 4096


def cpu_threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


class TensorParallelRank:
    def __init__(
        self, plan: ShardPlan, group: ParallelGroup, workers: Workers | None = None, threads: int = 0
    ):
        """`workers` and `threads` (torch's CPU threads before the start) on rank 0 only."""
        self.plan, self.group, self.workers = plan, group, workers
        self.lora_slots: LoRAPool | None = None  # set by `build`
        # Rank 0: what must go before the group is left (the runner's CUDA graphs; see `hold`).
        self._held: list = []
        # Rank 0: the workers' vocabulary rows of the loads in the headers being sent (`_loaded`).
        self._vocab_rows: list = []
        # Rank 0: also when the runner is dropped without shutdown() (its start-up failed, say).
        self._leave = (
            weakref.finalize(self, _leave, self._held, workers, group, threads)
            if workers is not None
            else None
        )

    @classmethod
    def start(cls, config, model_path: Path, hf_config, max_model_len: int) -> TensorParallelRank:
        """Rank 0: check the split, start the workers (they load their shards meanwhile), join the group."""
        plan = ShardPlan.for_model(
            hf_config, config.tensor_parallel_size, config.quantization, config.enable_expert_parallel
        )
        device = config.torch_device
        if device.type == "cuda":
            needed = (device.index or 0) + plan.world_size
            if torch.cuda.device_count() < needed:
                raise ValueError(
                    f"tensor_parallel_size {plan.world_size} from {device} needs {needed} GPUs; "
                    f"{torch.cuda.device_count()} are visible"
                )
        if dist.is_initialized():
            gc.collect()  # an engine dropped without shutdown() leaves the group when it is collected
        if dist.is_initialized():
            raise RuntimeError(
                "this process already runs a tensor-parallel engine (or its process group could not be torn "
                "down): shut it down first (LLM.shutdown(), or `with LLM(...) as llm:`), or start a new process"
            )
        threads = torch.get_num_threads()
        if device.type == "cpu":  # the ranks share the cores: idle OpenMP threads of one starve the others
            torch.set_num_threads(cpu_threads_per_rank(plan.world_size))
        port = free_port()
        try:
            workers = Workers(config, str(model_path), max_model_len, port)
            try:
                group = ParallelGroup.join(0, plan.world_size, port, device)
            except BaseException:
                workers.stop()
                raise
        except BaseException:
            torch.set_num_threads(threads)
            raise
        group.on_failure = workers.failure
        # NCCL: rank 0's kernels that wait on the lost peer return now, not at the collective timeout.
        workers.on_death.append(group.abort)
        return cls(plan, group, workers, threads)

    @property
    def rank(self) -> int:
        return self.group.rank

    def build(self, config, model_path: Path, hf_config, dtype, max_model_len: int, backend: str):
        """(model, adapter slots) of this rank: its shard of the weights, its shard of every slot."""
        device = self.group.device
        tp = TensorParallel(self.rank, self.plan.world_size, self.group)
        try:
            self.group.use_fused_add_norm(config.fused_allreduce)  # before the layers ask for it
            model = load_model(
                model_path,
                hf_config,
                dtype,
                device,
                max_model_len,
                backend,
                config.quantization,
                config.fp8_gemm,
                tp,
                config.load_format,
                config.enable_expert_parallel,
            )
        except BaseException:
            self.shutdown()  # rank 0: no worker outlives a start-up that failed, and the group is left
            raise
        budget, vocab = config.lora_pool_rank_budget, config.max_vocab_loras
        if self.rank == 0:
            slots = RankZeroLoRASlots(
                self.plan, config.max_loras, config.max_lora_rank, dtype, device, budget, vocab
            )
        else:
            shape = self.plan.local_shape
            slots = LoRAPool(shape, config.max_loras, config.max_lora_rank, dtype, device, budget, vocab)
        local = slots.local_layout if self.rank == 0 else slots.layout
        slots.dora_base = DoraBase(model, local, self.group, ROW_PARALLEL)
        self.lora_slots = slots
        return model, slots

    # -- rank 0 ---------------------------------------------------------------------------------------

    def hold(self, *objects) -> None:
        """Keep `objects` (the CUDA graphs) until the shutdown sequence drops them, before the group goes."""
        self._held.extend(o for o in objects if o is not None)

    def check(self) -> None:
        """Raise TensorParallelError if the watchdog lost the workers (a death, or a step that hung)."""
        if self.workers is not None and self.workers.failed_reason is not None:
            raise self.workers.failure()

    @contextmanager
    def step_guard(self) -> Iterator[None]:
        """One engine step (launches and read-backs): timed by the watchdog, checked before and after,
        so a step whose collectives a failure cut short never returns outputs."""
        self.check()
        self.workers.begin_step()
        try:
            yield
        finally:
            self.workers.end_step()
        self.check()

    def send_eager(
        self, input_ids, meta: AttentionMetadata, token_slots, logits_rows, prompt_rows=None
    ) -> None:
        """`prompt_rows`: hidden rows whose logits rank 0 computes for prompt logprobs (before the
        sampling rows), in the order it computes them; None: none."""
        loads = self._loads()
        self.workers.send(
            [
                encode(
                    EagerStep(
                        loads=loads[r],
                        num_tokens=input_ids.numel(),
                        block_table_width=meta.block_tables.shape[1],
                        num_logits_rows=logits_rows.numel(),
                        num_prompt_rows=0 if prompt_rows is None else prompt_rows.numel(),
                        prompt_chunk_rows=logit_chunk_rows(self.plan.vocab_size),
                        use_lora=token_slots is not None,
                        query_start_loc=meta.query_start_loc,
                        seq_lens=meta.seq_lens,
                    )
                )
                for r in range(len(loads))
            ]
        )
        self._loaded()
        parts = [input_ids, meta.positions, meta.slot_mapping, meta.block_tables.reshape(-1), logits_rows]
        if token_slots is not None:
            parts.append(token_slots.long())
        if prompt_rows is not None:
            parts.append(prompt_rows)
        self.group.broadcast(torch.cat(parts))

    def send_graph(self, buffers: DecodeTwins, num_seqs: int, size: int, use_lora: bool) -> None:
        loads = self._loads()
        self.workers.send(
            [
                encode(GraphStep(loads=loads[r], num_seqs=num_seqs, size=size, use_lora=use_lora))
                for r in range(len(loads))
            ]
        )
        self._loaded()
        self._broadcast_graph_inputs(buffers, size)

    def send_verify(self, buffers, size: int, use_lora: bool) -> None:
        """A verification graph step (spec_decode/verify_graphs.py): its lanes' buffers, then the replay."""
        loads = self._loads()
        self.workers.send(
            [encode(VerifyStep(loads=loads[r], size=size, use_lora=use_lora)) for r in range(len(loads))]
        )
        self._loaded()
        self._broadcast_verify_inputs(buffers, size)

    def _loads(self) -> list[list[SlotLoad]]:
        """Per worker, the adapter shards rank 0 put into slots since the last step (vocabulary rows of
        adapters' own embeddings and heads wait for `_loaded`)."""
        pending = self.lora_slots.take_pending()
        self._vocab_rows = [p.vocab for p in pending if p.vocab]
        return [
            [
                SlotLoad(
                    p.slot,
                    p.pages,
                    tensor_bytes(p.shards[r].weights),
                    tensor_bytes(p.shards[r].table),
                    p.vocab_table,
                )
                for p in pending
            ]
            for r in range(self.plan.world_size - 1)
        ]

    def _loaded(self) -> None:
        """After a step's headers, as each worker runs `apply_loads`: the workers' vocabulary rows of the
        adapters just loaded (load by load, worker by worker, tensor by tensor), then the DoRA scales."""
        for load_rows in self._vocab_rows:  # per adapter loaded: its rows for each worker
            for worker_parts in load_rows:
                for tensor in (t for part in worker_parts for t in part):
                    for start in range(0, tensor.shape[0], VOCAB_CHUNK_ROWS):  # bounded device staging
                        chunk = tensor[start : start + VOCAB_CHUNK_ROWS]
                        self.group.broadcast(chunk.to(self.group.device))
        self._vocab_rows = []
        self.lora_slots.finish_dora()  # with the workers, once they applied these loads

    def shutdown(self) -> None:
        """Rank 0: the shutdown sequence (module docstring), so another engine may form a group here."""
        if self._leave is not None:
            self._leave()

    # -- workers --------------------------------------------------------------------------------------

    def apply_loads(self, loads: list[SlotLoad]) -> None:
        slots = self.lora_slots
        for load in loads:
            weights = bytes_tensor(load.weights, slots.dtype)
            table = bytes_tensor(load.table, torch.int32).view(slots.table.shape[:2])
            slots.load(load.slot, SlotImage(slots.layout, weights, table), load.pages)
            if load.vocab_table:  # its own embedding / head: this rank's vocabulary rows
                vocab_table = bytes_tensor(load.vocab_table, torch.int32).view(2, TABLE_COLUMNS)
                slots.vocab.load(load.slot, self._receive_vocab(vocab_table), vocab_table)
        slots.finish_dora()  # with rank 0 and the other workers (engine/lora/dora.py)

    def _receive_vocab(self, table: torch.Tensor) -> list[tuple]:
        """This rank's vocabulary rows of an adapter's own embedding and head (vocab.rank_parts), out of
        rank 0's broadcasts of every worker's (`_loaded`; their shapes follow from the table): its own
        land on the device, the others' pass through one chunk at a time."""
        device, dtype = self.group.device, self.lora_slots.dtype
        hidden = self.lora_slots.vocab.matrices[0].shape[2]
        mine: list[tuple] = []
        for rank in range(1, self.plan.world_size):
            start, end = self.plan.vocab_range(rank)
            for shapes in part_shapes(table, end - start, hidden):
                part = []
                for shape in shapes:
                    keep = torch.empty(shape, dtype=dtype, device=device) if rank == self.rank else None
                    for first in range(0, shape[0], VOCAB_CHUNK_ROWS):
                        rows = min(VOCAB_CHUNK_ROWS, shape[0] - first)
                        chunk = keep[first : first + rows] if keep is not None else None
                        if chunk is None:
                            chunk = torch.empty((rows, *shape[1:]), dtype=dtype, device=device)
                        self.group.broadcast(chunk)
                    part.append(keep)
                if rank == self.rank:
                    mine.append(tuple(part))
        return mine

    def receive_eager(self, step: EagerStep):
        """(input_ids, meta, token slots or None, logits rows, prompt rows or None), as rank 0's
        `send_eager` had them."""
        n, num_seqs, width = step.num_tokens, len(step.seq_lens), step.block_table_width
        sizes = [n, n, n, num_seqs * width, step.num_logits_rows, n if step.use_lora else 0]
        sizes.append(step.num_prompt_rows)
        packed = torch.empty(sum(sizes), dtype=torch.long, device=self.group.device)
        parts = self.group.broadcast(packed).split(sizes)
        meta = AttentionMetadata(
            positions=parts[1],
            slot_mapping=parts[2],
            block_tables=parts[3].view(num_seqs, width),
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
        )
        token_slots = parts[5].int() if step.use_lora else None
        return parts[0], meta, token_slots, parts[4], parts[6] if step.num_prompt_rows else None

    def receive_graph(self, buffers: DecodeTwins, size: int) -> None:
        self._broadcast_graph_inputs(buffers, size)

    def receive_verify(self, buffers, size: int) -> None:
        self._broadcast_verify_inputs(buffers, size)

    def _broadcast_graph_inputs(self, buffers: DecodeTwins, size: int) -> None:
        """The decode graphs' static inputs, rank 0's into everyone's (rows past `size` are not read)."""
        self.group.broadcast(buffers.longs.device)
        self.group.broadcast(buffers.ints.device)
        self.group.broadcast(buffers.block_tables.device[:size])

    def _broadcast_verify_inputs(self, buffers, size: int) -> None:
        """The verification graphs' static inputs (VerifyTwins), rank 0's into everyone's."""
        self.group.broadcast(buffers.longs.device)
        self.group.broadcast(buffers.token_slots.device)
        self.group.broadcast(buffers.seq_lens.device)
        self.group.broadcast(buffers.block_tables.device[:size])

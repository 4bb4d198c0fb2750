"""Draft-model proposals: a smaller model with the target's vocabulary, run without adapters.

The draft keeps a KV cache of its own laid out exactly like the target's: the same block ids and slots
(its cache has its own layer count and head sizes), so it needs no block manager. Each step with
proposals, after scheduling, it

1. catches up: computes every scheduled request's known tokens it has not seen (prefill chunks, the
   token kept last step, a whole prompt after a preemption), which ends in the last known token; its
   logits give the first proposal d0 for the requests that speculate;
2. proposes: k - 1 passes of one token per speculating request (d0, then d1, ...), greedy (argmax).

All of it writes only slots the scheduler allocated for this step (the step computes the last known
token plus k proposals; the draft writes the last known token plus k - 1). Rejected proposals need no
undo: `_computed` falls back to the target's `num_computed_tokens` and the slots are rewritten.
"""

from __future__ import annotations

import torch

from engine.model.attention import AttentionMetadata
from engine.model.loader import load_config, load_model, resolve_model_path


class DraftModelProposer:
    def __init__(self, model: str, runner, max_model_len: int):
        path = resolve_model_path(model)
        hf_config = load_config(path)
        limit = getattr(hf_config, "max_position_embeddings", None)
        if limit is not None and limit < max_model_len:
            raise ValueError(
                f"the draft model {model!r} supports {limit} positions, fewer than max_model_len "
                f"{max_model_len}; lower max_model_len"
            )
        target_vocab = runner.model.vocab_size
        if hf_config.vocab_size != target_vocab:
            raise ValueError(
                f"the draft model {model!r} has a vocabulary of {hf_config.vocab_size} tokens, the target "
                f"{target_vocab}: a draft model must share the target's tokenizer"
            )
        self.model = load_model(
            path, hf_config, runner.dtype, runner.device, max_model_len, runner.attention_backend
        )
        self.device = runner.device
        self.block_size = runner.block_size
        m = self.model
        shape = (runner.num_kv_blocks + 1, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
            )
            for _ in range(m.num_layers)
        ]
        # request id -> (tokens whose draft KV is in the cache, the request's preemption count then)
        self._computed: dict[str, tuple[int, int]] = {}
        self._pad_block = runner.num_kv_blocks  # the target's scratch block: warm-up writes go there
        if self.device.type == "cuda":
            self._warm_up(runner.config.max_num_seqs)

    @torch.inference_mode()
    def propose(self, scheduled) -> None:
        """Fill the scheduled proposals (`spec_token_ids[:num_spec_tokens]`) of this step's requests."""
        if not any(s.num_spec_tokens for s in scheduled):
            return  # requests catch up in the next step that speculates
        seqs = []
        for s in scheduled:
            request = s.request
            known_end = s.start + s.num_new_tokens - s.num_spec_tokens
            done, preemptions = self._computed.get(request.request_id, (0, request.num_preemptions))
            if preemptions != request.num_preemptions:
                done = 0  # new blocks: the draft's KV is gone
            first = min(done, s.start)
            seqs.append((request.all_token_ids[first:known_end], first, s.block_ids))
            self._computed[request.request_id] = (known_end, request.num_preemptions)
        last_logits = self._forward(seqs)  # [num_seqs, vocab]
        speculating = [i for i, s in enumerate(scheduled) if s.num_spec_tokens]
        proposals = last_logits[speculating].argmax(dim=-1).tolist()
        drafts = {i: [token] for i, token in zip(speculating, proposals)}
        for step in range(1, max(scheduled[i].num_spec_tokens for i in speculating)):
            active = [i for i in speculating if scheduled[i].num_spec_tokens > step]
            seqs = []
            for i in active:
                s = scheduled[i]
                position = s.start + s.num_new_tokens - s.num_spec_tokens + step - 1
                seqs.append(([drafts[i][-1]], position, s.block_ids))
            for i, token in zip(active, self._forward(seqs).argmax(dim=-1).tolist()):
                drafts[i].append(token)
        for i in speculating:
            s = scheduled[i]
            s.request.spec_token_ids[: s.num_spec_tokens] = drafts[i]
            known_end = s.start + s.num_new_tokens - s.num_spec_tokens
            self._computed[s.request.request_id] = (
                known_end + s.num_spec_tokens - 1,
                s.request.num_preemptions,
            )

    @torch.inference_mode()
    def _forward(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """One pass over (tokens, first position, block ids) per sequence; float32 logits of each
        sequence's last token [num_seqs, vocab]."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens = []
        for tokens, first, blocks in seqs:
            span = range(first, first + len(tokens))
            ids.extend(tokens)
            positions.extend(span)
            slots.extend(blocks[p // bs] * bs + p % bs for p in span)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(first + len(tokens))
        width = max(len(blocks) for _, _, blocks in seqs)
        table = [blocks + [0] * (width - len(blocks)) for _, _, blocks in seqs]
        device = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            block_tables=torch.tensor(table, device=device),
            query_start_loc=starts,
            seq_lens=seq_lens,
        )
        hidden = self.model.forward(torch.tensor(ids, device=device), meta, self.kv_caches, None)
        last = torch.tensor(starts[1:], device=device) - 1
        return self.model.compute_logits(hidden[last])

    def _warm_up(self, max_num_seqs: int) -> None:
        """Compile the draft's attention variants before the engine is marked ready: one prefill pass, and
        a decode pass at each batch size whose key splits differ (see engine/warmup.py)."""
        from engine.model.paged_attention_triton import decode_num_splits

        sizes: dict[int, int] = {}
        for size in range(1, max_num_seqs + 1):
            sizes.setdefault(decode_num_splits(size, self.model.num_kv_heads, self.device), size)
        pad = [self._pad_block]  # one block: positions stay below block_size
        self._forward([([0] * min(2, self.block_size), 0, pad)])
        for size in sizes.values():
            self._forward([([0], min(1, self.block_size - 1), pad)] * size)
        torch.cuda.synchronize(self.device)

    def free(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

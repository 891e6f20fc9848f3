"""InputBatch: the model runner's persistent per-request state (vLLM V1's name).

Each running request owns a slot (a row of every array below) from the step it enters the batch
until it leaves. A step applies the scheduler's changes (``SchedulerOutput``: requests that left,
new requests, newly allocated pages) to these arrays instead of rebuilding them, then
``prepare_inputs.InputBuilder`` builds the step's flat inputs from them with vectorized numpy.
"""

import numpy as np

from jaxserve.core.scheduler_output import NewRequestData, SchedulerOutput
from jaxserve.worker.sampling_fields import PER_SLOT


class InputBatch:
    """Per-slot arrays for at most ``max_num_seqs`` requests.

    Attributes:
      token_ids: [max_num_seqs, max_model_len] int32, each request's known tokens.
      num_tokens: [max_num_seqs] int32, how many of them are known to the host.
      num_prompt_tokens: [max_num_seqs] int32.
      num_computed_tokens: [max_num_seqs] int32, tokens whose K/V the steps dispatched so far
        compute.
      block_table: [max_num_seqs, max_pages_per_seq] int32 page ids (0, the null page, pads).
        The model runner keeps a copy on the device and sends it only what changed
        (``take_block_table_changes``).
      num_blocks: [max_num_seqs] int32 valid entries of each block_table row.
      lora_int_id: [max_num_seqs] int32, the request's LoRA adapter (``LoRARequest``'s id; 0:
        the base model); lora_slot: its slot in the device pool this step (the model runner's
        ``LoRAModelManager.activate`` sets it).
      one [max_num_seqs] array per ``sampling_fields.PER_SLOT`` field, by its name and of its
        dtype (temperature, top_k, ..., num_logprobs): the request's sampling settings.
      in_flight_row, in_flight_step: [max_num_seqs] int32, the row and the step (a counter)
        whose sampled token is this request's newest token while the host does not know it yet
        (async scheduling), else -1 and -1. The step after that one reads the token from the
        device; ``record_sampled`` writes it into token_ids once it reaches the host.
      in_flight_drafts: [max_num_seqs] int32, the drafts that step verifies for the request
        (the rows before in_flight_row that are its; the n-gram method's steps settle them on
        the device, ``spec_decode.device_drafts``).
      hidden_pos: [max_num_seqs] int32, the position whose target hidden state an EAGLE
        head's carry holds for the slot (``ModelRunner.slot_hidden``), -1: none.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, max_pages_per_seq: int):
        n = max_num_seqs
        self.token_ids = np.zeros((n, max_model_len), np.int32)  # untouched pages stay unmapped
        self.num_tokens = np.zeros(n, np.int32)
        self.num_prompt_tokens = np.zeros(n, np.int32)
        self.num_computed_tokens = np.zeros(n, np.int32)
        self.block_table = np.zeros((n, max_pages_per_seq), np.int32)
        self.num_blocks = np.zeros(n, np.int32)
        self.lora_int_id = np.zeros(n, np.int32)
        self.lora_slot = np.zeros(n, np.int32)
        for f in PER_SLOT:
            setattr(self, f.name, np.full(n, f.default, f.dtype))
        self.hidden_pos = np.full(n, -1, np.int32)
        self.in_flight_row = np.full(n, -1, np.int32)
        self.in_flight_step = np.full(n, -1, np.int64)
        self.in_flight_drafts = np.zeros(n, np.int32)
        self.req_index: dict[str, int] = {}
        self._free_slots = list(range(n - 1, -1, -1))
        self._changed_blocks: list[tuple[int, int, int]] = []  # (slot, first, end) columns

    def update_states(self, sched: SchedulerOutput) -> list[tuple[int, NewRequestData]]:
        """Apply a step's changes: drop requests that left, add new ones, append new pages.
        Ids it does not hold (a request aborted before it ever ran) are ignored. Returns the
        new requests (with their slots) whose sampler state row must be written (penalties, a
        logit bias or min_tokens)."""
        needs_state = []
        for rid in sched.finished_req_ids:
            i = self.req_index.pop(rid, None)
            if i is not None:
                self._free_slots.append(i)
        for r in sched.new_reqs:
            i = self._free_slots.pop()
            self.req_index[r.req_id] = i
            n = len(r.token_ids)
            self.token_ids[i, :n] = r.token_ids
            self.num_tokens[i] = n
            self.num_prompt_tokens[i] = r.num_prompt_tokens
            self.num_computed_tokens[i] = r.num_computed_tokens
            self.lora_int_id[i] = r.lora_request.lora_int_id if r.lora_request else 0
            # The slot's earlier request wrote its first num_blocks entries: they go back to 0.
            self._changed_blocks.append((i, 0, max(self.num_blocks[i], len(r.block_ids))))
            self.block_table[i] = 0
            self.block_table[i, : len(r.block_ids)] = r.block_ids
            self.num_blocks[i] = len(r.block_ids)
            for f in PER_SLOT:
                getattr(self, f.name)[i] = f.of_request(r)
            if self.penalized[i] or self.logit_bias[i] or self.min_tokens[i]:
                needs_state.append((i, r))
            self.in_flight_row[i] = self.in_flight_step[i] = self.hidden_pos[i] = -1
        for rid, pages in sched.new_block_ids.items():
            i = self.req_index[rid]
            b = self.num_blocks[i]
            self.block_table[i, b : b + len(pages)] = pages
            self.num_blocks[i] = b + len(pages)
            self._changed_blocks.append((i, b, b + len(pages)))
        return needs_state

    def take_block_table_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block_table entries written since the last call, as (rows, columns, page ids),
        each [N] int32; clears the record."""
        spans, self._changed_blocks = self._changed_blocks, []
        spans = [(i, a, e) for i, a, e in spans if e > a]
        if not spans:
            empty = np.zeros(0, np.int32)
            return empty, empty, empty
        rows = np.concatenate([np.full(e - a, i, np.int32) for i, a, e in spans])
        cols = np.concatenate([np.arange(a, e, dtype=np.int32) for _, a, e in spans])
        return rows, cols, self.block_table[rows, cols]

    def record_sampled(self, step: int, rows: np.ndarray, req_ids: list[str],
                       tokens: list[list[int]], rejected: list[int]) -> None:
        """Append the tokens that step ``step`` emitted for ``req_ids`` (their last logits rows
        ``rows``; a request that verified drafts emits its accepted ones, then the sampled
        token) to the requests still in the batch, take back the computed positions of their
        ``rejected`` drafts (their K/V are written again by later steps), and clear the
        in-flight mark of those whose newest token that was. Tokens of one request arrive in
        step order, so each is its next token."""
        for rid, row, toks, back in zip(req_ids, rows.tolist(), tokens, rejected):
            i = self.req_index.get(rid)
            if i is None:
                continue  # left the batch (finished, aborted or preempted) meanwhile
            n = self.num_tokens[i]
            self.token_ids[i, n : n + len(toks)] = toks
            self.num_tokens[i] = n + len(toks)
            self.num_computed_tokens[i] -= back
            if self.in_flight_step[i] == step and self.in_flight_row[i] == row:
                self.in_flight_row[i] = self.in_flight_step[i] = -1

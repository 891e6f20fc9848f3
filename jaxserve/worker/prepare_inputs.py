"""InputBuilder: a step's host inputs, built with vectorized numpy from the InputBatch and the
SchedulerOutput (vLLM V1's ``_prepare_inputs``): the packed step inputs of its token bucket,
the sampler metadata, the rows to draw again, the prompt log-probability rows, and the host
arguments of the other programs a step dispatches.
"""

from dataclasses import dataclass

import numpy as np

from jaxserve.core.scheduler_output import NewRequestData, SchedulerOutput
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.sampler import filtered_rows
from jaxserve.worker.sampling_fields import (FILTER, SAMPLING, FilterMetadata, SamplingMetadata,
                                             fields_of)
from jaxserve.worker.step_inputs import StepLayout


@dataclass
class StepInputs:
    """A step's host inputs (n sequences scheduled, m logits rows: one per sequence plus one
    per draft token, L = the bucket's logits rows).

    Attributes:
      packed: [layout.size] int32, the step's inputs (``StepLayout.pack``).
      early_block_table_writes: (rows, cols, pages) chunks of W entries each, to write to the
        device block table before the step (the changes that do not fit in ``packed``).
      req_ids: the n scheduled requests, in sequence order.
      slots: [n] int32 their InputBatch slots.
      context: [n] int32 each sequence's length after the step (drafts included).
      samples: [n] bool, the sequences that sample their request's next token.
      num_drafts: [n] int32 draft tokens each sequence verifies (speculative decoding).
      last_rows: [n] int32 each sequence's last logits row (the one after its drafts).
      row_seq: [m] int32 each logits row's sequence.
      row_steps: [m] int32 the tokens the request generated before the row's token.
      draft_ids, seq_start: [m] int32, FilterMetadata's fields of the rows.
      sm: the rows' SamplingMetadata (numpy, [L]).
      prompt_spans, prompt_targets: as ``StepHandle``.
    """

    packed: np.ndarray
    early_block_table_writes: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    req_ids: list[str]
    slots: np.ndarray
    context: np.ndarray
    samples: np.ndarray
    num_drafts: np.ndarray
    last_rows: np.ndarray
    row_seq: np.ndarray
    row_steps: np.ndarray
    draft_ids: np.ndarray
    seq_start: np.ndarray
    sm: SamplingMetadata
    prompt_spans: list[tuple[str, int, int, int, int]]
    prompt_targets: np.ndarray


@dataclass
class FilterInputs:
    """What a step's filtered sampler needs from the host ([L] rows).

    Attributes:
      fm: the FilterMetadata when some row is drawn again or wants log-probabilities, else
        None (the step dispatches no filtered sampler).
      structured: [L] bool, the constrained rows.
      want_logprobs: some row wants the log-probabilities of its token.
      logprob_ks: [n] int32 log-probabilities wanted per sequence (-1: none).
    """

    fm: FilterMetadata | None
    structured: np.ndarray
    want_logprobs: bool
    logprob_ks: np.ndarray


def _padded(values: np.ndarray, s: int, fill, dtype) -> np.ndarray:
    """[s] of ``dtype``: ``values`` first, then ``fill``."""
    out = np.full(s, fill, dtype)
    out[: len(values)] = values
    return out


@dataclass
class InputBuilder:
    """Builds the host inputs of each step from ``batch``.

    Attributes:
      batch: the runner's InputBatch (read; ``num_computed_tokens`` and the in-flight marks are
        the runner's to update after a dispatch).
      layouts: the StepLayout of each token bucket.
      page_size: tokens per page.
      vocab_size: the model's vocabulary.
      max_num_seqs, max_model_len: scheduler limits.
      prompt_logprob_rows: R, prompt positions a step computes log-probabilities of.
      block_table_writes: W, block table entries a step's inputs carry.
      bias_width, stop_width: widths of the SamplingState's logit-bias and stop-id tables.
      num_speculative_tokens: k, the most drafts a sequence verifies (speculative decoding).
    """

    batch: InputBatch
    layouts: dict[int, StepLayout]
    page_size: int
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    prompt_logprob_rows: int
    block_table_writes: int
    bias_width: int
    stop_width: int
    num_speculative_tokens: int = 0

    def state_row(self, slot: int, r: NewRequestData) -> tuple:
        """The arguments, after the state, of ``sampler.write_state_row`` for a request
        entering the batch at ``slot``."""
        vocab = self.vocab_size
        tokens = np.zeros(self.max_model_len, np.int32)
        tokens[: len(r.token_ids)] = r.token_ids
        bias = r.sampling_params.logit_bias or {}
        bias_ids = np.full(self.bias_width, vocab, np.int32)
        bias_ids[: len(bias)] = list(bias)
        bias_values = np.zeros(self.bias_width, np.float32)
        bias_values[: len(bias)] = list(bias.values())
        stop_ids = np.full(self.stop_width, vocab, np.int32)
        stop_ids[: len(r.stop_token_ids)] = r.stop_token_ids
        return (np.int32(slot), tokens, np.int32(r.num_prompt_tokens), np.int32(len(r.token_ids)),
                bias_ids, bias_values, stop_ids)

    def build(self, sched: SchedulerOutput, t: int, last_step: int) -> StepInputs:
        """The inputs of a step of token bucket t; ``last_step`` is the counter of the step
        dispatched before it. Takes the InputBatch's block table changes. A sequence's draft
        tokens (``sched.scheduled_spec_decode_tokens``) are its last scheduled tokens and get
        a logits row each before its own (docs/spec_decode.md). Drafts the host knows follow
        its known tokens in its InputBatch row (scratch space until the step's tokens are
        recorded there); the n-gram method's (-1 each: the step makes them,
        ``spec_decode.device_drafts``) get their place among the step's (``draft_at``,
        ``spec_seqs``), and the previous step's drafts of the token fed from the device
        (``prev_drafts``), which the step settles.

        Raises:
          RuntimeError: a token the host does not know is not the last step's (a scheduling
            bug), or the prompt log-probability rows exceed R.
        """
        b = self.batch
        layout = self.layouts[t]
        s = layout.seqs
        n_tok = sched.total_num_scheduled_tokens
        req_ids = list(sched.num_scheduled_tokens)
        n_seq = len(req_ids)
        ps = self.page_size
        slots = np.fromiter((b.req_index[r] for r in req_ids), np.int32, n_seq)
        counts = np.fromiter(sched.num_scheduled_tokens.values(), np.int32, n_seq)
        drafts = sched.scheduled_spec_decode_tokens
        num_drafts = np.fromiter((len(drafts.get(r, ())) for r in req_ids), np.int32, n_seq)
        on_device = np.fromiter((drafts.get(r, (0,))[0] < 0 for r in req_ids), bool, n_seq)
        for r, d in drafts.items():
            if d[0] >= 0:
                i = b.req_index[r]
                b.token_ids[i, b.num_tokens[i] : b.num_tokens[i] + len(d)] = d
        computed = b.num_computed_tokens[slots]
        ends = np.cumsum(counts, dtype=np.int32)
        seq_of_tok = np.repeat(np.arange(n_seq, dtype=np.int32), counts)
        tok_slot = slots[seq_of_tok]
        index = np.arange(n_tok, dtype=np.int32) - (ends - counts)[seq_of_tok]  # in its sequence
        pos = computed[seq_of_tok] + index
        draft_index = index - (counts - num_drafts)[seq_of_tok]  # >= 0: a draft
        unknown = (draft_index < 0) & (pos >= b.num_tokens[tok_slot])
        if unknown.any() and (b.in_flight_step[tok_slot[unknown]] != last_step).any():
            raise RuntimeError("a scheduled token is neither known nor sampled by the last step")
        made = (draft_index >= 0) & on_device[seq_of_tok]
        spec_seqs = np.flatnonzero(on_device).astype(np.int32)
        if len(spec_seqs) > layout.drafting_seqs:
            raise RuntimeError(f"{len(spec_seqs)} sequences draft on the device, past the "
                               f"step's {layout.drafting_seqs}")

        token_ids = np.zeros(t, np.int32)
        token_ids[:n_tok] = np.where(unknown | made, 0,
                                     b.token_ids[tok_slot, np.minimum(pos, self.max_model_len - 1)])
        prev_rows = np.full(t, -1, np.int32)
        prev_rows[:n_tok] = np.where(unknown, b.in_flight_row[tok_slot], -1)
        prev_drafts = np.zeros(t, np.int32)
        prev_drafts[:n_tok] = np.where(unknown, b.in_flight_drafts[tok_slot], 0)
        rank = np.cumsum(on_device, dtype=np.int32) - 1  # among the sequences drafting here
        draft_at = np.full(t, -1, np.int32)
        draft_at[:n_tok] = np.where(
            made, rank[seq_of_tok] * self.num_speculative_tokens + draft_index, -1)
        positions = np.zeros(t, np.int32)
        positions[:n_tok] = pos
        slot_mapping = np.zeros(t, np.int32)  # padding writes to the null page
        slot_mapping[:n_tok] = b.block_table[tok_slot, pos // ps] * ps + pos % ps
        lora_slots = np.zeros(t, np.int32)  # padding: the base model
        lora_slots[:n_tok] = b.lora_slot[tok_slot]
        qsl = np.full(s + 1, n_tok, np.int32)
        qsl[0] = 0
        qsl[1 : n_seq + 1] = ends
        context = computed + counts  # each sequence's length after this step
        seq_lens = np.zeros(s, np.int32)
        seq_lens[:n_seq] = np.where(counts > 0, context, 0)  # a forked row attends to nothing
        seq_slots = np.zeros(s, np.int32)  # padding rows attend to nothing (seq_lens 0)
        seq_slots[:n_seq] = slots
        # Logits rows: a sequence's last num_drafts + 1 tokens each score the token after them.
        num_rows = num_drafts + 1
        last_rows = np.cumsum(num_rows, dtype=np.int32) - 1
        row_seq = np.repeat(np.arange(n_seq, dtype=np.int32), num_rows)
        seq_start = (last_rows - num_drafts)[row_seq]
        back = last_rows[row_seq] - np.arange(len(row_seq), dtype=np.int32)  # rows to the last
        logits_indices = np.zeros(layout.num_logits_rows, np.int32)
        logits_indices[: len(row_seq)] = ends[row_seq] - 1 - back
        if sched.forked_from:
            row_of = {r: last_rows[i] for i, r in enumerate(req_ids)}
            for child, parent in sched.forked_from.items():
                logits_indices[row_of[child]] = logits_indices[row_of[parent]]
        # the draft each row verifies: the token after the row's own
        row_slots = slots[row_seq]
        verified = np.minimum(context[row_seq] - back, self.max_model_len - 1)
        draft_ids = np.where(back > 0, b.token_ids[row_slots, verified], -1).astype(np.int32)
        samples = np.fromiter((sched.samples[r] for r in req_ids), bool, n_seq)
        hidden_indices, prompt_spans, targets = self._prompt_logprob_rows(
            sched, req_ids, slots, computed, counts, ends)

        # tokens generated before the row's: the position of the token it samples minus the
        # prompt (the sequence's length after the step, less the rows after it)
        row_steps = (context - b.num_prompt_tokens[slots])[row_seq] - back
        sm = SamplingMetadata(**self.gather(SAMPLING, row_slots, layout.num_logits_rows,
                                             steps=row_steps))
        (bt_rows, bt_cols, bt_pages), early = self._block_table_writes()
        packed = layout.pack(dict(
            token_ids=token_ids, prev_rows=prev_rows, prev_drafts=prev_drafts,
            draft_at=draft_at, spec_seqs=_padded(spec_seqs, layout.drafting_seqs, -1, np.int32),
            positions=positions,
            slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens,
            seq_slots=seq_slots, logits_indices=logits_indices, hidden_indices=hidden_indices,
            block_table_rows=bt_rows, block_table_cols=bt_cols, block_table_pages=bt_pages,
            lora_slots=lora_slots, **vars(sm)))
        return StepInputs(packed, early, req_ids, slots, context, samples, num_drafts,
                          last_rows, row_seq, row_steps, draft_ids, seq_start, sm,
                          prompt_spans, targets)

    def filter_inputs(self, sched: SchedulerOutput, x: StepInputs,
                      draft_prob_rows: np.ndarray | None = None) -> FilterInputs:
        """The filtered sampler's inputs of the step ``x``: the rows drawn again (penalties,
        a logit bias, min_tokens, min-p, top-k/top-p, a grammar, a draft model's sampled draft
        to verify) and those wanting log-probabilities. ``draft_prob_rows``: [m] int32, per
        logits row, its draft's row of the draft model's q (-1: none); None: no draft model."""
        b, n_rows, rows = self.batch, len(x.row_seq), len(x.sm.temperature)
        if draft_prob_rows is None:
            draft_prob_rows = np.full(n_rows, -1, np.int32)
        slots = x.slots[x.row_seq]
        samples = x.samples[x.row_seq]
        logprob_ks = b.num_logprobs[slots]
        suppress = b.min_tokens[slots] > x.row_steps
        redraw = (b.penalized[slots] | b.logit_bias[slots] | suppress
                  | ((b.temperature[slots] > 0) & (b.min_p[slots] > 0)))
        redraw |= filtered_rows(x.sm, self.vocab_size)[:n_rows]
        redraw |= (draft_prob_rows >= 0) & (b.temperature[slots] > 0)
        structured = self._structured_rows(sched, x, rows)
        redraw |= structured[:n_rows]
        want_logprobs = samples & (logprob_ks >= 0)
        fm = None
        if redraw.any() or want_logprobs.any():
            fm = FilterMetadata(**self.gather(
                FILTER, slots, rows, rows=redraw, slots=slots, suppress_stop=suppress,
                count=samples & b.penalized[slots], logprobs=want_logprobs,
                structured=structured, draft_ids=x.draft_ids, seq_start=x.seq_start,
                draft_prob_rows=draft_prob_rows))
        return FilterInputs(fm, structured, bool(want_logprobs.any()), b.num_logprobs[x.slots])

    def page_copies(self, sched: SchedulerOutput) -> tuple[np.ndarray, np.ndarray] | None:
        """(src, dst), each [max_num_seqs] int32 (0 -> 0 pads), of the step's page copies
        (forked choices), or None."""
        if not sched.copy_pages:
            return None
        src = np.zeros(self.max_num_seqs, np.int32)
        dst = np.zeros(self.max_num_seqs, np.int32)
        src[: len(sched.copy_pages)], dst[: len(sched.copy_pages)] = zip(*sched.copy_pages)
        return src, dst

    def gather(self, group: str, slots: np.ndarray, s: int, /, **computed: np.ndarray) -> dict:
        """Each field of ``group`` for the step's rows, padded to s with its default: the
        InputBatch's slot values for a per-slot field, else its ``computed`` values."""
        return {f.name: _padded(computed[f.name] if f.of_request is None
                                else getattr(self.batch, f.name)[slots], s, f.default, f.dtype)
                for f in fields_of(group)}

    def _structured_rows(self, sched: SchedulerOutput, x: StepInputs, rows: int) -> np.ndarray:
        """[L] bool: the rows of the step's constrained sequences (a sequence's drafts' rows
        and its last row; ``Scheduler.grammar_bitmask`` gives them in this order)."""
        structured = np.zeros(rows, bool)
        if sched.structured_output_request_ids:
            seq_of = {r: i for i, r in enumerate(x.req_ids)}
            for r in sched.structured_output_request_ids:
                last = x.last_rows[seq_of[r]]
                structured[last - x.num_drafts[seq_of[r]] : last + 1] = True
        return structured

    def _no_block_table_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """W entries that write nothing (rows past the table are dropped)."""
        w = self.block_table_writes
        return (np.full(w, self.max_num_seqs, np.int32), np.zeros(w, np.int32),
                np.zeros(w, np.int32))

    def _block_table_writes(self) -> tuple[tuple, list[tuple]]:
        """The InputBatch's block table entries written since the last step, as (the last W,
        padded, for the step to write to the device copy; W at a time, those before them)."""
        rows, cols, pages = self.batch.take_block_table_changes()
        w = self.block_table_writes
        chunks = []
        for a in range(0, len(rows), w):
            r, c, p = self._no_block_table_writes()
            n = min(w, len(rows) - a)
            r[:n], c[:n], p[:n] = rows[a : a + n], cols[a : a + n], pages[a : a + n]
            chunks.append((r, c, p))
        if not chunks:
            return self._no_block_table_writes(), []
        return chunks[-1], chunks[:-1]

    def _prompt_logprob_rows(self, sched, req_ids, slots, computed, counts, ends):
        """For the requests in ``sched.prompt_logprobs``: the flat-batch rows of their scheduled
        prompt positions that predict a next prompt token, padded to R, the spans (see
        StepHandle) and the tokens predicted."""
        rows = np.zeros(self.prompt_logprob_rows, np.int32)
        targets = np.zeros(self.prompt_logprob_rows, np.int32)
        spans, used = [], 0
        if not sched.prompt_logprobs:
            return rows, spans, targets
        b = self.batch
        for i, rid in enumerate(req_ids):
            if rid not in sched.prompt_logprobs:
                continue
            slot = slots[i]
            first = computed[i]  # position of the chunk's first token
            n = min(computed[i] + counts[i], b.num_prompt_tokens[slot] - 1) - first
            if n <= 0:
                continue
            if used + n > len(rows):
                raise RuntimeError("prompt log-probability rows exceed the step's capacity")
            rows[used : used + n] = ends[i] - counts[i] + np.arange(n)
            targets[used : used + n] = b.token_ids[slot, first + 1 : first + 1 + n]
            k = b.num_prompt_logprobs[slot]
            spans.append((rid, int(first) + 1, used, int(n), int(k)))
            used += n
        return rows, spans, targets

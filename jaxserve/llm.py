"""LLM: offline batch generation that drives the EngineCore in process (vLLM's ``LLM``)."""

from collections.abc import Sequence

from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine import EngineCoreRequest
from jaxserve.engine.core import EngineCore
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams


class LLM:
    """Generate text for many prompts at once with continuous batching.

    Args:
      model: None for the default model (SmolLM2-135M-Instruct, fetched on first use); a GGUF
        file, an HF folder, an orbax folder, or with ``load_format="dummy"`` a preset such as
        ``"llama-3.1-8b"`` or a config.json path.
      **kwargs: other EngineConfig fields (``max_model_len``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``dtype``, ``kv_cache_gib``, ``load_format``, ...).

    Raises:
      ValueError: an unusable model or settings (see EngineCore).
    """

    def __init__(self, model: str | None = None, *, log=print, **kwargs):
        self.engine = EngineCore(EngineConfig(model=model, **kwargs), log=log)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); results in input order.

        Raises:
          ValueError: a prompt that is empty or does not fit max_model_len (before any work).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, self.tokenizer.encode(p, add_special_tokens=False)))
            else:
                items.append((None, [int(t) for t in p]))
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them,
        through the model's chat template with the assistant turn opened."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        items = []
        for conv in messages:
            prompt = self.tokenizer.apply_chat_template(
                list(conv), add_generation_prompt=True, tokenize=False
            )
            items.append((prompt, self.tokenizer.encode(prompt, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items, sampling_params, use_tqdm) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(items)
        if len(sampling_params) != len(items):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(items)} prompts"
            )
        limit = self.engine.max_model_len
        for i, (_, ids) in enumerate(items):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len is {limit}")
        live: dict[str, tuple[int, IncrementalDetokenizer]] = {}
        results: list[RequestOutput | None] = [None] * len(items)
        for i, ((prompt, ids), sp) in enumerate(zip(items, sampling_params)):
            rid = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(EngineCoreRequest(rid, ids, sp))
            detok = IncrementalDetokenizer(self.tokenizer, stop=sp.stop, prompt_token_ids=ids)
            live[rid] = (i, detok)
            results[i] = RequestOutput(rid, prompt, ids, [CompletionOutput(0, "", [])])
        bar = tqdm(total=len(items), desc="generating", disable=not use_tqdm, unit="req")
        while live:
            for out in self.engine.step():
                i, detok = live[out.request_id]
                completion = results[i].outputs[0]
                completion.token_ids.extend(out.new_token_ids)
                detok.update(out.new_token_ids)
                results[i].num_cached_tokens = out.num_cached_tokens
                if detok.stop_matched is not None:
                    self.engine.abort_requests([out.request_id])
                    completion.finish_reason, completion.stop_reason = "stop", detok.stop_matched
                elif out.finished:
                    detok.flush()
                    completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
                else:
                    continue
                completion.text = detok.output_text
                del live[out.request_id]
                bar.update(1)
        bar.close()
        return results

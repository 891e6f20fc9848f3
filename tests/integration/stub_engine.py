"""A JAX-free stand-in for EngineCore, for server failure tests (engine crashes, slow start-up).

Served by ``python -m stub_server`` (stub_server.py puts it in place of EngineCore).
It uses the default model's tokenizer and "generates" a fixed text; a few magic prompts make it
misbehave:
  * prompts starting with ADD_CRASH_ID: add_request raises (not a ValueError);
  * prompts starting with STEP_CRASH_ID: step() raises once that request has a token, and
    ``recover_from_failed_step`` ends that request alone;
  * prompts starting with STEP_POISON_ID: the same, but the engine cannot go on after it
    (as when a failed program took the KV pool down);
  * prompts starting with STEP_REPEAT_ID: every step raises while that request is there, and
    ``recover_from_failed_step`` does not find it (a failure no request explains).
Environment: STUB_START_DELAY_S (sleep in __init__), STUB_START_ERROR (raise ValueError with it).
"""

import os
import time

from jaxserve.config import resolve_config
from jaxserve.engine import EngineCoreOutput, SchedulerStats
from jaxserve.platforms import CPU

ADD_CRASH_ID = 4242
STEP_CRASH_ID = 4343
STEP_POISON_ID = 4444
STEP_REPEAT_ID = 4545
TEXT = " The quick brown fox jumps over the lazy dog. Café 😀 中文 naïve."


class StubEngineCore:
    def __init__(self, config, log=print):
        from jaxserve.model_loader import default_tokenizer
        from jaxserve.model_loader.tokenizer_export import TokenizerExport

        log("stub engine: starting")
        # The tokenizer's folder first, as EngineCore's start-up begins with it.
        self.tokenizer_dir = TokenizerExport("smollm2-135m", "dummy").wait()
        self.tokenizer = default_tokenizer()
        log("stub engine: tokenizer ready")
        time.sleep(float(os.environ.get("STUB_START_DELAY_S", "0")))
        if os.environ.get("STUB_START_ERROR"):
            raise ValueError(os.environ["STUB_START_ERROR"])
        # Resolved as on the CPU, for a model as long as --max-model-len (1024 unset).
        self.config = resolve_config(config, CPU, config.max_model_len or 1024)
        self.model_name = "stub-model"
        self.eos_token_ids = (self.tokenizer.eos_token_id,)
        self.vocab_size = len(self.tokenizer)
        self.allocator_fraction = 0.0  # the stub starts no JAX backend
        self.generation_config = {}
        self.lora_manager = None  # no --enable-lora
        self.num_pages = 0  # Ready's num_gpu_blocks: the stub has no KV pool
        self.text_ids = self.tokenizer.encode(TEXT, add_special_tokens=False)
        self.reqs = {}
        self.failed = []  # (request id, usable) of the step that raised

    def add_request(self, req):
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty")
        if req.prompt_token_ids[0] == ADD_CRASH_ID:
            raise RuntimeError("stub add_request failure")
        self.reqs[req.request_id] = [req, []]

    def abort_requests(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        time.sleep(0.02)
        outs = []
        for rid, (req, out) in list(self.reqs.items()):
            if req.prompt_token_ids[0] == STEP_REPEAT_ID:
                raise RuntimeError("stub step failure")
            if req.prompt_token_ids[0] in (STEP_CRASH_ID, STEP_POISON_ID) and out:
                self.failed = [(rid, req.prompt_token_ids[0] == STEP_CRASH_ID)]
                raise RuntimeError("stub step failure")
            tok = self.text_ids[len(out) % len(self.text_ids)]
            out.append(tok)
            sp = req.sampling_params
            done = sp.max_tokens is not None and len(out) >= sp.max_tokens
            outs.append(EngineCoreOutput(rid, [tok], "length" if done else None, None,
                                         len(req.prompt_token_ids), 0))
            if done:
                del self.reqs[rid]
        return outs

    def recover_from_failed_step(self):
        failed, self.failed = self.failed, []
        self.abort_requests([rid for rid, _ in failed])
        return [rid for rid, _ in failed], all(usable for _, usable in failed)

    def get_stats(self):
        return SchedulerStats(num_running_reqs=len(self.reqs),
                              kv_cache_usage=min(1.0, len(self.reqs) / 100))

"""Offline greedy generation at several tensor-parallel sizes in one process of fake CPU devices.

Run by the tensor-parallel tests as ``python -m tests.integration.tp_generate`` in a subprocess
whose ``XLA_FLAGS`` holds ``--xla_force_host_platform_device_count=N`` (JAX reads it when it
starts, so the test process itself keeps its one device). Reads a JSON spec on stdin::

    {"prompts": [text, ...], "max_tokens": 16, "flags": {EngineConfig fields},
     "runs": [{"model": path or null, "tp": 3, "flags": {more fields}}, ...],
     "collectives_of": path or null}

and writes one JSON object on stdout: ``{"MODEL:TP": {"prompt_ids": [[...]], "output_ids":
[[...]]}, ...}``, plus ``"collectives"``: the collective ops of the compiled largest step of
``collectives_of`` at each size above 1 (``{"TP": {"all-reduce": n, ...}, "gathered": [shape
of each all-gather]}``).
"""

import collections
import json
import re
import sys

COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def collectives(runner) -> dict:
    """Collective ops in the compiled program of the runner's largest token bucket."""
    t = runner.token_buckets[-1]
    args = runner.placeholder_args(runner.k_cache, runner.v_cache)
    text = runner.programs.step[t].lower(*args.step[t]).compile().as_text()
    found = COLLECTIVE.findall(text)
    return {"ops": dict(collections.Counter(op for _, op in found)),
            "gathered": [shape for shape, op in found if op == "all-gather"]}


def main() -> None:
    from jaxserve import LLM, SamplingParams

    spec = json.load(sys.stdin)
    sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
    out = {"collectives": {}}
    for run in spec["runs"]:
        llm = LLM(run["model"], tensor_parallel_size=run["tp"], log=lambda s: None,
                  **spec["flags"] | run.get("flags", {}))
        results = llm.generate(spec["prompts"], sp, use_tqdm=False)
        out[f"{run['model']}:{run['tp']}"] = {
            "prompt_ids": [r.prompt_token_ids for r in results],
            "output_ids": [r.outputs[0].token_ids for r in results]}
        if run["model"] == spec.get("collectives_of") and run["tp"] > 1 and not run.get("flags"):
            out["collectives"][str(run["tp"])] = collectives(llm.engine.runner)
        del llm
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

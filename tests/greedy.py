"""docs/architecture.md's "Testing numerics" "identical greedy outputs": equal token ids up to the
first near-tie of the reference (its two best logits within 1e-3), where float rounding may pick
either."""

import numpy as np

NEAR_TIE = 1e-3


def top2_margins(logits: np.ndarray) -> np.ndarray:
    """[N, V] logits -> [N] gap between the best and second-best logit."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def _hf_logits(hf_model, prompt_ids: list[int], generated: list[int]) -> np.ndarray:
    """[len(generated), V] HF logits at each generated position (one forward, teacher-forced)."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(generated)])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].numpy()
    n = len(prompt_ids)
    return logits[n - 1 : n - 1 + len(generated)]


def hf_greedy_margins(hf_model, prompt_ids: list[int], generated: list[int]) -> np.ndarray:
    """Gaps at each generated position, from one HF forward over prompt + generated tokens."""
    return top2_margins(_hf_logits(hf_model, prompt_ids, generated))


def hf_greedy_tokens(hf_model, prompt_ids: list[int], generated: list[int]) -> list[int]:
    """HF's argmax at each generated position, the earlier positions teacher-forced."""
    return _hf_logits(hf_model, prompt_ids, generated).argmax(-1).tolist()


def compare_greedy(ours: list[int], ref: list[int], ref_margins: np.ndarray) -> tuple[bool, int]:
    """(identical, positions compared): stop at the reference's first near-tie."""
    n = min(len(ours), len(ref))
    for i in range(n):
        if ref_margins[i] < NEAR_TIE:
            return True, i
        if ours[i] != ref[i]:
            return False, i
    return len(ours) == len(ref), n


def hf_generate(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy ``generate`` of ``max_new_tokens`` after ``prompt_ids``."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def assert_equals_hf_greedy(hf_model, prompts: list[list[int]], outputs: list[list[int]],
                            max_new_tokens: int) -> None:
    """Each of ``outputs`` (token ids) equals HF's greedy tokens of its prompt up to the
    reference's first near-tie (``compare_greedy``)."""
    for ids, ours in zip(prompts, outputs, strict=True):
        ref = hf_generate(hf_model, ids, max_new_tokens)
        ok, n = compare_greedy(ours, ref, hf_greedy_margins(hf_model, ids, ref))
        assert ok, (n, ours, ref)

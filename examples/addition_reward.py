"""A reward function for the demo's single-digit sums (docs/rewards.md). Run:
    PYTHONPATH=examples bash scripts/demo.sh --sampling.reward.functions addition_reward:exact_sum
"""


def exact_sum(prompt: dict, completion: str, token_ids: list[int], metadata: dict) -> dict:
    """1 for the right sum; 0.1 for a wrong answer that is at least a number (logged apart)."""
    answer = completion.strip()
    correct = answer == prompt["gt_answer"]
    return {
        "correct": float(correct),
        "is_number": 0.1 if answer.isdigit() and not correct else 0.0,
        "solved": correct,
    }

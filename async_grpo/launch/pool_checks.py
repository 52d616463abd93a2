"""The launcher's checks of the frozen pools a run asks for, before Ray or any worker starts: a
teacher that shares the student's tokenizer, judge workers for a reward that names the judge.
Each exits 2 with one line naming the flag to pass (run_config.exit_config_error)."""

from __future__ import annotations

from async_grpo.config.run_config import exit_config_error


def check_judge_pool(program: str, judge_workers: int, uses_judge: bool) -> None:
    """A reward that names the judge needs judge workers: without them every judged sample would
    wait for a worker that never comes, then fail."""
    if uses_judge and not judge_workers:
        exit_config_error(program, "the trainer's sampling.reward names the judge but no judge worker starts: "
                                   "pass --judge_workers N (and --judge_model_path P, default the policy's model)")


def check_teacher_model(program: str, teacher_path: str, student_path: str) -> None:
    """The teacher folder loads and shares the student's tokenizer (what the trainer checks again
    against the running teacher workers)."""
    from async_grpo.config.model_path import ModelPathError, check_model_dir
    from setup_model import load_tokenizer, tokenizer_fingerprint

    try:
        check_model_dir(teacher_path)
        same = tokenizer_fingerprint(load_tokenizer(teacher_path)) == tokenizer_fingerprint(load_tokenizer(student_path))
    except ModelPathError as error:
        exit_config_error(program, f"teacher: {error}")
    if not same:
        exit_config_error(program, f"the teacher ({teacher_path}) and the student ({student_path}) have "
                                   "different tokenizers; distillation needs one tokenizer for both")

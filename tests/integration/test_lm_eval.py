"""lm-eval, the standard evaluation harness, scores a multiple-choice task of our own through `swarm api`
(`local-completions`: echo + logprobs, lists of prompts at `batch_size` 4, the remote tokenizer endpoints)
and gets the same per-choice log-likelihoods and accuracy as its own `hf` backend running the same
checkpoint in this process. The task's data ships in tests/data/lm_eval (no dataset hub here)."""

from __future__ import annotations

from pathlib import Path

import lm_eval  # a test dependency (pyproject's `test` extra)
import pytest

from swarm.weights.models import local_model_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA = Path(__file__).parent.parent / "data" / "lm_eval" / "questions.jsonl"
TASK = "swarm_questions"
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The task definition, pointing at the shipped data by absolute path."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {DATA}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n")
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def api(demo_swarm, demo_model_dir):
    proc = demo_swarm.start_api("api-lm-eval", demo_model_dir, "--context-length", "256")
    yield proc.extra["url"]
    demo_swarm.stop("api-lm-eval")


def evaluate(tasks, model: str, model_args: dict, batch_size: int) -> tuple[float, dict[int, list[float]]]:
    """Accuracy, and each document's per-choice log-likelihoods."""
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=tasks,
                                  batch_size=batch_size, log_samples=True)
    samples = out["samples"][TASK]
    lls = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in samples}
    return out["results"][TASK]["acc,none"], lls


def test_scores_through_the_swarm_equal_lm_evals_own_hf_backend(api, tasks, demo_model_dir):
    want_acc, want = evaluate(tasks, "hf", {"pretrained": str(demo_model_dir), "dtype": "float32", "device": "cpu"}, 1)
    assert len(want) == sum(1 for _ in DATA.open())
    for batch_size in (1, 4):
        acc, got = evaluate(tasks, "local-completions",
                            {"model": local_model_id(demo_model_dir), "base_url": f"{api}/completions",
                             "num_concurrent": 1, "max_retries": 1}, batch_size)
        assert sorted(got) == sorted(want)
        for doc, lls in want.items():
            assert got[doc] == pytest.approx(lls, abs=TOLERANCE), f"document {doc}, batch size {batch_size}"
        assert acc == want_acc

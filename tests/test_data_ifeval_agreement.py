"""Two independent codes agree: the generator's compliance labels and the IFEval scorer's verdicts."""

from orpo.data.synth import generate_labeled_rows, generate_eval_prompts
from orpo.eval.ifeval import evaluate


def test_generator_labels_match_the_ifeval_scorer():
    checked = 0
    for item in generate_labeled_rows(300, 5):
        if not item.instruction_id_list:
            continue
        inputs = [{"key": 0, "prompt": item.row["instruction"], "instruction_id_list": item.instruction_id_list,
                   "kwargs": item.kwargs}]
        for completion, follows in zip(item.row["completions"], item.follows):
            verdict = evaluate(inputs, {item.row["instruction"]: completion["response"]}, "strict")[0]
            assert verdict["follow_instruction_list"] == follows, (item.row["id"], completion["response"])
            checked += len(follows)
    assert checked > 500


def test_eval_prompts_score_zero_on_empty_answers_and_take_every_kwarg():
    prompts = generate_eval_prompts(60, 3)
    results = evaluate(prompts, {p["prompt"]: "ok" for p in prompts}, "strict")
    assert len(results) == 60
    assert any(not r["follow_all_instructions"] for r in results)

"""Pairwise LLM judging as MT-Bench does it: both orders per question, [[A]]/[[B]]/[[C]] verdicts, win rates."""

from orpo.eval.judge.core import NoVerdicts, judge_files, judge_pairs, make_judge
from orpo.eval.judge.http_judge import JudgeRequestError, JudgeUnavailable
from orpo.eval.judge.questions import Question, load_questions, read_answers, write_prompts

__all__ = ["JudgeRequestError", "JudgeUnavailable", "NoVerdicts", "Question", "judge_files", "judge_pairs",
           "load_questions", "make_judge", "read_answers", "write_prompts"]

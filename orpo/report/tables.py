"""Tables: the paper's IFEval layout with the published numbers beside ours, judge win rates, HTML summaries."""

from __future__ import annotations

import html
from typing import Any

from orpo.report.sources import IFEVAL_METRICS

# The paper's columns: (key in config paper.models[].published, key in ifeval.json, header).
PAPER_COLUMNS = (
    ("prompt_strict", "prompt_level_strict_acc", "Prompt-Strict"),
    ("prompt_loose", "prompt_level_loose_acc", "Prompt-Loose"),
    ("inst_strict", "inst_level_strict_acc", "Inst-Strict"),
    ("inst_loose", "inst_level_loose_acc", "Inst-Loose"),
)
TRAINED = "orpo"  # the ifeval stage's label of the trained adapter; "base" is the base model
JUDGE_RATES = ("win_rate", "tie_rate", "loss_rate", "adjusted_win_rate")


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def _ci(ci: dict[str, Any] | None) -> str:
    if not ci or ci.get("lo") is None:
        return "–"
    return f"[{ci['lo']:.4f}, {ci['hi']:.4f}]"


def paper_rows(spec: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per paper model: published, ours (the trained adapter), our 95% CI and ours minus published, per column."""
    rows = []
    for model in spec["models"]:
        exp = model["experiment"]
        if exp not in results:
            raise ValueError(f"paper table: no IFEval results for experiment {exp!r}")
        ours_all = results[exp]["models"].get(TRAINED)
        if ours_all is None:
            raise ValueError(f"paper table: experiment {exp!r}'s ifeval.json has no {TRAINED!r} model")
        published = model.get("published") or {}
        row = {"label": model["label"], "experiment": exp, "prompts": ours_all.get("prompts"),
               "published": {}, "ours": {}, "ci": {}, "difference": {}}
        for key, metric, _ in PAPER_COLUMNS:
            ours = ours_all[metric]
            row["published"][key] = published.get(key)
            row["ours"][key] = ours
            row["ci"][key] = ours_all.get("ci95", {}).get(metric)
            row["difference"][key] = None if published.get(key) is None else ours - published[key]
        rows.append(row)
    return rows


def paper_table(spec: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    """The IFEval table in the paper's layout (markdown): published, ours, our 95% CI, ours minus published."""
    rows = paper_rows(spec, results)
    head = "| Model | | " + " | ".join(h for _, _, h in PAPER_COLUMNS) + " |"
    lines = [f"# {spec.get('title') or spec.get('name') or 'IFEval'}", "",
             ("IFEval accuracies of each model's ORPO adapter (this pipeline) beside the published numbers; "
              "the difference is ours minus published."), "", head, "|---|---|" + "---:|" * len(PAPER_COLUMNS)]
    for row in rows:
        cells = {
            "published": [_fmt(row["published"][k]) for k, _, _ in PAPER_COLUMNS],
            f"ours (`{row['experiment']}`, {row['prompts']} prompts)": [_fmt(row["ours"][k]) for k, _, _ in PAPER_COLUMNS],
            "ours, 95% CI": [_ci(row["ci"][k]) for k, _, _ in PAPER_COLUMNS],
            "ours − published": [_fmt(row["difference"][k], signed=True) for k, _, _ in PAPER_COLUMNS],
        }
        for i, (what, values) in enumerate(cells.items()):
            lines.append(f"| {row['label'] if i == 0 else ''} | {what} | " + " | ".join(values) + " |")
    first = results[rows[0]["experiment"]]["models"].get("base") if rows else None
    if first:
        lines += ["", "The base model on the same prompts (ours; `" + rows[0]["experiment"] + "`): " + ", ".join(
            f"{h} {_fmt(first[m])}" for _, m, h in PAPER_COLUMNS) + "."]
    return "\n".join(lines) + "\n"


def paper_judge_table(spec: dict[str, Any], summaries: dict[str, dict[str, Any]]) -> str:
    """Judge win rates of each paper model's adapter against the base model (markdown)."""
    lines = [f"# {spec.get('title') or spec.get('name') or 'Judge'}: pairwise judge", "",
             ("Each model's ORPO adapter against the base model, judged in both answer orders; rates over judged "
              "questions with 95% bootstrap intervals. The paper reports no such head-to-head numbers."), "",
             "| Model | judged | win | tie | loss | inconsistent | error | win rate | adjusted win rate |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for model in spec["models"]:
        exp = model["experiment"]
        if exp not in summaries:
            raise ValueError(f"paper judge table: no judge summary for experiment {exp!r}")
        s = summaries[exp]
        c = s["counts"]
        rates = [f"{_fmt(s[r]['estimate'])} {_ci(s[r])}" for r in ("win_rate", "adjusted_win_rate")]
        lines.append(f"| {model['label']} (`{exp}`) | {s['judged']} | {c['win']} | {c['tie']} | {c['loss']} | "
                     f"{c['inconsistent']} | {c['error']} | " + " | ".join(rates) + " |")
    return "\n".join(lines) + "\n"


def html_table(headers: list[str], rows: list[list[Any]], title: str = "") -> str:
    """A small standalone HTML page holding one table (cells escaped)."""
    def cell(v: Any) -> str:
        return html.escape(_fmt(v) if isinstance(v, float) else "–" if v is None else str(v))

    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>\n" for r in rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            "<style>table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:2px 8px;text-align:right}"
            "td:first-child{text-align:left}</style></head><body>\n"
            f"<h3>{html.escape(title)}</h3>\n<table>\n<tr>{head}</tr>\n{body}</table>\n</body></html>\n")


def ifeval_html(result: dict[str, Any]) -> str:
    """IFEval accuracies per model with 95% intervals, and the differences against the reference model."""
    rows = []
    for label, m in result["models"].items():
        rows.append([label, m.get("prompts")] + [f"{_fmt(m[k])} {_ci(m.get('ci95', {}).get(k))}" for k in IFEVAL_METRICS])
    for label, d in result.get("differences", {}).items():
        rows.append([label, ""] + [f"{_fmt(d[k]['estimate'], signed=True)} {_ci(d[k])}" for k in IFEVAL_METRICS])
    return html_table(["model", "prompts", *IFEVAL_METRICS], rows, "IFEval")


def curation_html(manifests: dict[str, dict[str, Any]]) -> str:
    """Rows in, rows out and each drop reason's count, per stage manifest."""
    rows = []
    for stage, m in manifests.items():
        rows.append([stage, "input rows", m.get("input_rows")])
        out = m.get("output_rows")
        for split, n in (out.items() if isinstance(out, dict) else [("total", out)]):
            rows.append([stage, f"output rows ({split})", n])
        for reason, d in sorted((m.get("dropped") or {}).items()):
            rows.append([stage, f"dropped: {reason}", d.get("count") if isinstance(d, dict) else d])
    return html_table(["stage", "what", "count"], rows, "Curation and rendering")


def benchmarks_html(records: dict[str, dict[str, float | None]]) -> str:
    """Wall time, max RSS, CPU time and mean load per rule."""
    rows = [[rule, r.get("s"), r.get("max_rss"), r.get("cpu_time"), r.get("mean_load")] for rule, r in records.items()]
    return html_table(["rule", "wall time (s)", "max RSS (MB)", "CPU time (s)", "mean load (%)"], rows, "Benchmarks")


def judge_html(summary: dict[str, Any]) -> str:
    """Judge counts and rates with their 95% intervals."""
    rows = [[k, v] for k, v in summary["counts"].items()]
    rows += [[r, f"{_fmt(summary[r]['estimate'])} {_ci(summary[r])}"] for r in JUDGE_RATES if r in summary]
    return html_table(["outcome or rate", "value"], rows, f"Judge ({summary.get('judged')} of {summary.get('questions')} judged)")

"""`orpo <stage> ...`: parse arguments, call the stage core, nothing else."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from orpo.blas import reexec_with_openblas
from orpo.config import RENDER_STAGE_KEYS, SPIN_DAG_KEYS


def _settings(text: str) -> dict[str, Any]:
    """--settings takes JSON, or @file holding JSON; a bad one is named with its file, line and column."""
    source = None
    if text.startswith("@"):
        source = text[1:]
        try:
            text = Path(source).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {source}: {getattr(e, 'strerror', None) or e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{source}:{e.lineno}:{e.colno}" if source else f"line {e.lineno} column {e.colno}"
        raise argparse.ArgumentTypeError(f"{where}: not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{source or 'the value'}: expected a JSON object, got {type(value).__name__}")
    return value


# What each command's JSON arguments hold: (argument attribute, option, schema section, keys left out).
# They are exactly what the workflow's rules pass (workflow/rules/*.smk): a config section, spin's less
# the keys that shape the DAG (common.smk's spin_settings), render's prompt keys for --render-settings
# (the section less the keys only the render stage reads).
CHECKED = {
    "data": [("settings", "--settings", "data", ())],
    "curate": [("settings", "--settings", "curate", ())],
    "base": [("settings", "--settings", "base", ())],
    "quantize": [("settings", "--settings", "quantize", ())],
    "render": [("settings", "--settings", "render", ())],
    "train": [("settings", "--settings", "train", ())],
    "generate": [("settings", "--settings", "generate", ()),
                 ("render_settings", "--render-settings", "render", RENDER_STAGE_KEYS)],
    "spin": [("settings", "--settings", "spin", SPIN_DAG_KEYS),
             ("render_settings", "--render-settings", "render", RENDER_STAGE_KEYS)],
    "judge run": [("settings", "--settings", "judge", ())],
    "report paper-table": [("spec", "--spec", "paper", ())],
    "report paper-judge": [("spec", "--spec", "paper", ())],
}


# The sections whose stage reads typed settings: the class `check_settings` builds from the checked mapping;
# a section checked less some keys may have a class of its own (generation's part of render).
TYPED = {"train": "orpo.train.settings:TrainSettings", "curate": "orpo.curate.settings:CurateSettings",
         "base": "orpo.base.model:BaseSettings", "quantize": "orpo.base.quantize:QuantizeSettings",
         "generate": "orpo.eval.generate:GenerateSettings",
         "spin": "orpo.spin.settings:SpinSettings", "judge": "orpo.eval.judge.settings:JudgeSettings",
         "render": "orpo.render.settings:RenderSettings",
         ("render", RENDER_STAGE_KEYS): "orpo.render.settings:PromptSettings"}


def _typed(section: str, drop: tuple[str, ...]) -> type | None:
    path = TYPED.get((section, drop)) or TYPED.get(section)
    if path is None:
        return None
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def check_settings(args: argparse.Namespace) -> None:
    """Check a command's settings against the config schema before any work: unknown keys, wrong types.

    A section with typed settings (TYPED) is built here, once, into its frozen dataclass, the schema's
    defaults filled in; the others stay mappings, checked.
    """
    from orpo.config import validate_settings
    from orpo.settings import build

    command = " ".join(filter(None, [args.stage, getattr(args, "action", None)]))
    for attr, option, section, drop in CHECKED.get(command, []):
        cls = _typed(section, drop)
        value = getattr(args, attr)
        setattr(args, attr, build(cls, section, value, drop, option) if cls else
                validate_settings(section, value, drop=drop, what=option))


def _labelled(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    return label, path


def cmd_data(a: argparse.Namespace) -> Any:
    from orpo.data.synth import write_eval_prompts, write_rows

    if a.what == "rows":
        return {"rows": write_rows(a.out, a.settings.get("rows", a.n), a.settings.get("seed", a.seed))}
    return {"prompts": write_eval_prompts(a.out, a.n, a.seed)}


def cmd_curate(a: argparse.Namespace) -> Any:
    from orpo.curate.core import curate

    tokenizer = a.tokenizer
    if a.tokenizer_from:
        from orpo.render.template import resolve_model_dir

        tokenizer = str(resolve_model_dir(a.tokenizer_from) / "tokenizer.json")
    return curate(a.inputs, a.out, a.settings, tokenizer=tokenizer, eval_prompts=a.eval_prompts)


def cmd_base(a: argparse.Namespace) -> Any:
    from orpo.base.model import build_base

    return build_base(a.raw, a.out, a.settings, a.on_error)


def cmd_quantize(a: argparse.Namespace) -> Any:
    from orpo.base.quantize import quantize

    return quantize(a.model, a.out, a.settings)


def cmd_render(a: argparse.Namespace) -> Any:
    from orpo.render.pairs import render_pairs

    return render_pairs(a.model, a.curated, a.out, a.settings)


def cmd_train(a: argparse.Namespace) -> Any:
    from orpo.train.launch import launch, needs_launch

    dist = a.settings.distributed
    if needs_launch(dist):  # train.distributed.processes > 1: this same command as N ranks
        raise SystemExit(launch(a.argv, dist, Path(a.out) / "complete.json"))  # written last, either method
    from orpo.train.trainer import train

    index = train(a.model, a.rendered, a.out, a.settings, a.dtype)
    return None if index is None else {k: v for k, v in index.items() if k != "checkpoints"}


def cmd_replay(a: argparse.Namespace) -> Any:
    from orpo.io import write_json
    from orpo.train.launch import launch, needs_launch
    from orpo.folders import require_complete
    from orpo.train.settings import recorded_run

    settings, resolved, _ = recorded_run(require_complete(a.run, "training run"))  # a machine that cannot reproduce the run stops here
    dist = (resolved.settings if resolved else settings).distributed  # the backend the run resolved
    if needs_launch(dist):  # a run of N processes replays on N ranks, bit for bit
        raise SystemExit(launch(a.argv, dist, Path(a.out)))
    from orpo.train.trainer import replay

    record = replay(a.run, a.model, a.rendered, a.checkpoint, a.start)
    if record is None:  # a rank other than 0: rank 0 reports
        return None
    if not record["equal"]:
        write_json(Path(a.out).with_suffix(".mismatch.json"), record)
        raise SystemExit(f"orpo replay: step {record['step']} replayed to {record['replayed_sha256']}, "
                         f"but the checkpoint's sha256 is {record['expected_sha256']}")
    write_json(a.out, record)
    return record


def cmd_generate(a: argparse.Namespace) -> Any:
    from orpo.eval.generate import generate

    adapter = a.adapter
    if adapter:
        from orpo.train.checkpoint import checkpoint_folder

        adapter = checkpoint_folder(Path(adapter), a.checkpoint, "generate from")
    return generate(a.model, a.prompts, a.out, a.settings, adapter=adapter, label=a.label,
                    render=a.render_settings, limit=a.limit, dtype=a.dtype)


def cmd_chat(a: argparse.Namespace) -> Any:
    from orpo.chat import Chat, answer, interactive, piped, target
    from orpo.config import validate_settings
    from orpo.render.settings import RenderSettings
    from orpo.settings import build

    settings = validate_settings("generate", a.settings)
    # The whole section or its prompt keys, as a render manifest or a config file holds them.
    render = build(RenderSettings, "render", a.render_settings, what="--render-settings").prompt
    t = target(a.run, a.model, a.checkpoint, a.base, a.dtype, render if a.render_settings else None)
    print("chat: " + "; ".join(t.origin), file=sys.stderr)
    chat = Chat(t, settings, a.system)
    if a.prompt is not None:
        answer(chat, a.prompt, sys.stdout, a.show_prompt)
    elif sys.stdin.isatty():
        interactive(chat, sys.stdin, sys.stdout, a.show_prompt)
    else:
        piped(chat, sys.stdin, sys.stdout, a.show_prompt)


def cmd_ifeval_compare(a: argparse.Namespace) -> Any:
    from orpo.eval.ifeval.compare import compare_models

    result = compare_models(a.inputs, dict(a.generations), a.out, a.details, limit=a.limit)
    return {label: {k: v for k, v in m.items() if k.endswith("_acc")} for label, m in result["models"].items()}


def cmd_ifeval_score(a: argparse.Namespace) -> Any:
    from orpo.eval.ifeval.score import read_responses, score_to_dir
    from orpo.eval.ifeval.source import load_inputs

    s = score_to_dir(load_inputs(a.inputs), read_responses(a.responses), a.out)[2]
    return {k: v for k, v in s.items() if k.endswith("_acc") or k in ("prompts", "instructions")}


SOURCE_HELP = "a jsonl, an HF-style dataset folder or hub:OWNER/NAME[@REVISION][:SPLIT]"


def cmd_ifeval_prompts(a: argparse.Namespace) -> Any:
    from orpo.eval.ifeval.source import write_inputs

    return write_inputs(a.source, a.out)


def cmd_spin(a: argparse.Namespace) -> Any:
    from orpo.spin import spin_pairs

    return spin_pairs(a.sft, a.model, a.adapter, a.out, a.settings, a.iteration, render=a.render_settings,
                      dtype=a.dtype)


def cmd_judge_run(a: argparse.Namespace) -> Any:
    from orpo.eval.judge import judge_files

    r = judge_files(a.questions, a.a, a.b, a.out, a.settings, a.dtype)
    keys = ("questions", "judged", "counts", "win_rate", "adjusted_win_rate", "judged_now", "from_cache")
    return {k: r[k] for k in keys if k in r}


def cmd_judge_questions(a: argparse.Namespace) -> Any:
    from orpo.eval.judge.questions import write_mt_bench

    return write_mt_bench(a.source, a.out)


def cmd_judge_prompts(a: argparse.Namespace) -> Any:
    from orpo.eval.judge import load_questions, write_prompts

    questions, skipped = load_questions(a.prompt_set, a.questions)
    questions = questions[: a.limit] if a.limit > 0 else questions
    return {"prompts": write_prompts(questions, a.out), "skipped": skipped}


def cmd_config(a: argparse.Namespace) -> Any:
    from orpo.config import PROJECT_ROOT, load_config_file, validate_config
    from orpo.experiments import deep_merge, expand

    config: dict[str, Any] = {}
    for path in [PROJECT_ROOT / "config" / "config.yaml", *a.configfiles]:
        config = deep_merge(config, load_config_file(path))
    validate_config(config)
    return {"experiments": sorted(filter(None, expand(config))), "config": config}


def cmd_env(a: argparse.Namespace) -> Any:
    import importlib.metadata

    import mlx.core as mx

    maps = Path("/proc/self/maps")
    blas = sorted({ln.split()[-1] for ln in maps.read_text().splitlines() if "blas" in ln.lower()}) if maps.exists() else []
    versions = {}
    for dist in ("mlx", "mlx-lm", "snakemake", "polars", "tokenizers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {"python": sys.version.split()[0], "versions": versions, "device": str(mx.default_device()),
            "blas_loaded": blas}


def cmd_report_plots(a: argparse.Namespace) -> Any:
    from orpo.report.plots import write_plots

    return write_plots(a.run, a.ifeval, a.curated, a.rendered, dict(a.benchmarks), a.out, a.ifeval_details)


def cmd_report_judge(a: argparse.Namespace) -> Any:
    from orpo.report.plots import write_judge

    return write_judge(a.summary, a.out)


def cmd_report_summary(a: argparse.Namespace) -> Any:
    from orpo.report.summary import write_summary

    return write_summary(a.experiments, a.out, a.plot)


def cmd_report_show(a: argparse.Namespace) -> Any:
    from orpo.report.summary import show

    show(a.summary)


def cmd_report_objectives(a: argparse.Namespace) -> Any:
    from orpo.report.objectives import write_objectives

    return write_objectives(a.experiments, a.out, a.plot)


def cmd_report_paper(a: argparse.Namespace) -> Any:
    from orpo.io import write_text
    from orpo.report import tables
    from orpo.report.sources import read_json

    results = {label: read_json(path) for label, path in a.results}
    table = tables.paper_table if a.action == "paper-table" else tables.paper_judge_table
    write_text(a.out, table(a.spec, results))
    return {"out": a.out, "models": [m["label"] for m in a.spec["models"]]}


def add_dtype(p: argparse.ArgumentParser, default: Any = "", help_default: str = "") -> None:
    """--dtype: model.dtype, the dtype the loaded model computes in (default: the schema's)."""
    from orpo.config import load_schema

    node = load_schema()["properties"]["model"]["properties"]["dtype"]
    p.add_argument("--dtype", choices=node["enum"], default=node["default"] if default == "" else default,
                   help=f"model.dtype (default {help_default or node['default']}): " + node["description"])


def build_parser() -> argparse.ArgumentParser:
    """The `orpo` command line."""
    ap = argparse.ArgumentParser(prog="orpo", description="ORPO pipeline stages (each a Snakemake rule).")
    sub = ap.add_subparsers(dest="stage", required=True)

    def stage(name: str, fn: Callable, help: str, settings: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        if settings:
            p.add_argument("--settings", type=_settings, default={}, help="stage settings as JSON or @file")
        return p

    stage("env", cmd_env, "print versions, the MLX device and the BLAS libraries loaded", settings=False)

    p = stage("config", cmd_config, "check config files as `snakemake --configfile` would merge them, YAML errors "
              "by file:line:column; print the validated config", settings=False)
    p.add_argument("configfiles", nargs="*", type=Path, help="merged in order over config/config.yaml")

    p = stage("data", cmd_data, "generate the synthetic preference rows or the eval prompt set")
    p.add_argument("what", choices=["rows", "eval-prompts"])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=2400, help="rows or prompts (settings.rows wins for rows)")
    p.add_argument("--seed", type=int, default=0)

    p = stage("curate", cmd_curate, "binarize raw rows into chosen/rejected pairs")
    p.add_argument("--inputs", nargs="+", required=True, help="files, folders or hub ids")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", help="tokenizer.json for token-length filters")
    p.add_argument("--tokenizer-from", help="a model folder or hub id whose tokenizer.json to use")
    p.add_argument("--eval-prompts", help="jsonl of eval prompts to decontaminate against")

    p = stage("base", cmd_base, "build the embedded tiny model from raw rows")
    p.add_argument("--raw", required=True, help="raw rows: a .jsonl/.json/.parquet file, a folder of them or a hub id")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="a malformed row: stop naming it, or skip and count it (the workflow passes curate.on_error)")
    p.add_argument("--out", required=True)

    p = stage("quantize", cmd_quantize, "quantize a model folder or hub id's weights (LoRA on a quantized base: "
              "QLoRA); settings: the config's quantize section")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)

    p = stage("render", cmd_render, "render pairs through the chat template into token ids")
    p.add_argument("--model", required=True)
    p.add_argument("--curated", required=True)
    p.add_argument("--out", required=True)

    p = stage("train", cmd_train, "train an ORPO LoRA adapter")
    p.add_argument("--model", required=True)
    p.add_argument("--rendered", required=True)
    p.add_argument("--out", required=True)
    add_dtype(p)

    p = stage("replay", cmd_replay, "replay a checkpoint and verify its hash (a run of N processes replays on N ranks, "
              "bit for bit)", settings=False)
    p.add_argument("--run", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rendered", required=True)
    p.add_argument("--checkpoint", default="best_margin", help="best_margin, best_loss, final or a step")
    p.add_argument("--from", dest="start", default="previous", choices=["previous", "zero"])
    p.add_argument("--out", required=True)

    p = stage("generate", cmd_generate, "generate responses to the eval prompts")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", help="a training run folder (or adapter folder)")
    p.add_argument("--checkpoint", default="final", help="with a run folder: final, best_margin, best_loss or a step")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="model")
    p.add_argument("--render-settings", type=_settings, default={},
                   help="the render stage's settings (template override, template_kwargs) as JSON or @file")
    p.add_argument("--limit", type=int, default=0)
    add_dtype(p)

    p = stage("spin", cmd_spin, "SPIN pairs: SFT gold answers (chosen) vs the model's own answers (rejected)")
    p.add_argument("--sft", nargs="+", required=True,
                   help="SFT files, folders or hub ids: messages, prompt/response, or curated pairs")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", help="the generator's adapter: the previous iteration's run folder (none = base)")
    p.add_argument("--iteration", type=int, required=True, help="1, 2, ...; iteration k > 1 needs --adapter")
    p.add_argument("--render-settings", type=_settings, default={},
                   help="the render stage's settings (template override, template_kwargs) as JSON or @file")
    p.add_argument("--out", required=True)
    add_dtype(p)

    p = stage("chat", cmd_chat, "talk to a base model or a trained run through its training chat template and "
              "render settings: interactive on a terminal (/reset, /exit), one reply with --prompt, a turn per line "
              "when piped")
    p.add_argument("--run", help="a training run folder: its base model, adapter, dtype and render settings")
    p.add_argument("--checkpoint", default="final", help="with --run: final, best_margin, best_loss or a step")
    p.add_argument("--base", action="store_true", help="with --run: the run's base model without its adapter")
    p.add_argument("--model", help="the base model (folder or hub id); with --run, instead of the run's")
    p.add_argument("--prompt", help="one user message: print the reply and exit")
    p.add_argument("--system", help="a system message before the conversation")
    p.add_argument("--show-prompt", action="store_true",
                   help="print each rendered prompt (what the model sees) on stderr")
    p.add_argument("--render-settings", type=_settings, default={},
                   help="render settings (template, template_kwargs, date) as JSON or @file; default: the run's")
    add_dtype(p, default=None, help_default="the run's dtype, else auto")

    p = sub.add_parser("ifeval", help="IFEval scoring")
    isub = p.add_subparsers(dest="action", required=True)
    q = isub.add_parser("compare", help="score several models' generations on the same prompts")
    q.set_defaults(fn=cmd_ifeval_compare)
    q.add_argument("--inputs", required=True)
    q.add_argument("--generations", nargs="+", type=_labelled, required=True, help="LABEL=PATH, reference first")
    q.add_argument("--out", required=True)
    q.add_argument("--details", required=True)
    q.add_argument("--limit", type=int, default=0)
    q = isub.add_parser("score", help="score a responses file (IFEval reference formats)")
    q.set_defaults(fn=cmd_ifeval_score)
    q.add_argument("--inputs", required=True, help=SOURCE_HELP)
    q.add_argument("--responses", required=True)
    q.add_argument("--out", required=True)
    q = isub.add_parser("prompts", help="IFEval prompts from a dataset folder or hub id, as an input-format jsonl")
    q.set_defaults(fn=cmd_ifeval_prompts)
    q.add_argument("--source", required=True, help=SOURCE_HELP)
    q.add_argument("--out", required=True)

    p = sub.add_parser("judge", help="pairwise LLM judge (MT-Bench's protocol)")
    jsub = p.add_subparsers(dest="action", required=True)
    q = jsub.add_parser("run", help="judge model A against model B on the same questions, in both orders")
    q.set_defaults(fn=cmd_judge_run)
    q.add_argument("--questions", required=True,
                   help="curated folder / validation.parquet, or MT-Bench questions: " + SOURCE_HELP)
    q.add_argument("--a", type=_labelled, required=True, help="LABEL=generations.jsonl of the model whose win rate is reported")
    q.add_argument("--b", type=_labelled, required=True, help="LABEL=generations.jsonl of the reference model")
    q.add_argument("--out", required=True, help="folder for verdicts.jsonl, summary.json (and cache.jsonl by default)")
    q.add_argument("--settings", type=_settings, default={}, help="judge settings as JSON or @file")
    add_dtype(q)
    q = jsub.add_parser("prompts", help="write a prompt set's questions as prompts for `orpo generate`")
    q.set_defaults(fn=cmd_judge_prompts)
    q.add_argument("--prompt-set", choices=["validation", "mt_bench"], required=True)
    q.add_argument("--questions", required=True)
    q.add_argument("--limit", type=int, default=0)
    q.add_argument("--out", required=True)
    q = jsub.add_parser("questions", help="MT-Bench questions from a dataset folder or hub id, as FastChat's jsonl")
    q.set_defaults(fn=cmd_judge_questions)
    q.add_argument("--source", required=True, help=SOURCE_HELP)
    q.add_argument("--out", required=True)
    p = sub.add_parser("report", help="figures and tables from the pipeline's artifacts")
    rsub = p.add_subparsers(dest="action", required=True)
    q = rsub.add_parser("plots", help="training curves, IFEval by instruction type, manifests, benchmarks (PNG + HTML)")
    q.set_defaults(fn=cmd_report_plots)
    q.add_argument("--run", required=True, help="a training run folder (metrics.jsonl, index.json)")
    q.add_argument("--ifeval", required=True, help="the ifeval stage's summary json")
    q.add_argument("--curated", required=True)
    q.add_argument("--rendered", required=True)
    q.add_argument("--benchmarks", nargs="*", type=_labelled, default=[], help="RULE=benchmark.tsv (missing files skipped)")
    q.add_argument("--ifeval-details", help="the ifeval stage's details folder (per-instruction counts and intervals)")
    q.add_argument("--out", required=True, help="folder for the figures and tables")
    q = rsub.add_parser("summary", help="the run's summary across experiments: markdown table and figure")
    q.set_defaults(fn=cmd_report_summary)
    q.add_argument("--experiments", type=_settings, required=True,
                   help='{NAME: {"folder": results/[NAME/], "adapter": generate.adapter}} as JSON or @file')
    q.add_argument("--out", required=True, help="the summary markdown (results/summary.md)")
    q.add_argument("--plot", required=True, help="the summary figure (results/summary.png)")
    q = rsub.add_parser("objectives", help="the objectives comparison: validation margins, IFEval, margin and λ")
    q.set_defaults(fn=cmd_report_objectives)
    q.add_argument("--experiments", type=_settings, required=True,
                   help='{NAME: {"folder": results/NAME/, "adapter": generate.adapter}} as JSON or @file')
    q.add_argument("--out", required=True, help="the table (results/objectives/table.md)")
    q.add_argument("--plot", required=True, help="the figure (results/objectives/margin_lambda.png)")
    q = rsub.add_parser("show", help="print a summary markdown file as a console table")
    q.set_defaults(fn=cmd_report_show)
    q.add_argument("summary", help="results/summary.md")
    q = rsub.add_parser("judge", help="judge win-rate figure and table")
    q.set_defaults(fn=cmd_report_judge)
    q.add_argument("--summary", required=True, help="the judge stage's summary.json")
    q.add_argument("--out", required=True)
    for action, what in (("paper-table", "IFEval table in the paper's layout, published numbers beside ours"),
                         ("paper-judge", "judge win-rate table of the paper's models")):
        q = rsub.add_parser(action, help=what)
        q.set_defaults(fn=cmd_report_paper)
        q.add_argument("--spec", type=_settings, required=True, help="the config's paper section as JSON or @file")
        q.add_argument("--results", nargs="+", type=_labelled, required=True,
                       help="EXPERIMENT=ifeval.json (paper-table) or EXPERIMENT=judge/summary.json (paper-judge)")
        q.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `orpo` command."""
    argv = sys.argv[1:] if argv is None else argv
    reexec_with_openblas(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what a distributed launch re-runs as each rank
    try:
        check_settings(args)
        result = args.fn(args)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        if os.environ.get("ORPO_DEBUG"):
            traceback.print_exc()
        print(f"orpo {args.stage}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if result is not None:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
